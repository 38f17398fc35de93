"""Prompt lookup: propose what followed the most recent earlier occurrence of the context's
longest matching suffix. No model, no q (verification treats the guess as a point mass)."""

from __future__ import annotations

import torch

from specdec.core.drafts import BaseDrafter, Draft, DraftRequest, StepOutcome


class NGramIndex:
    """n-grams of a growing token sequence -> where the continuation of their latest occurrence
    starts. Updated incrementally as tokens arrive; never rescans the context."""

    def __init__(self, max_n: int = 4, min_n: int = 1, occurrences: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self._latest: dict[tuple[int, ...], int] = {}
        # With occurrences > 1: where the continuations of the most recent occurrences start,
        # newest first (the branches of an n-gram tree).
        self.occurrences = occurrences
        self._recent: dict[tuple[int, ...], list[int]] = {}
        self._indexed = 0  # n-grams ending before this position are in the index

    def extend(self, new_tokens: list[int]) -> None:
        self.tokens.extend(new_tokens)
        # Index n-grams ending before the last token: the suffix itself must not match itself.
        for end in range(self._indexed, len(self.tokens) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                key = tuple(self.tokens[end - n + 1 : end + 1])
                self._latest[key] = end + 1
                if self.occurrences > 1:
                    starts = self._recent.setdefault(key, [])
                    starts.insert(0, end + 1)
                    del starts[self.occurrences :]
        self._indexed = max(self._indexed, len(self.tokens) - 1)

    def find(self, suffix_source: list[int], before: int | None = None) -> tuple[int, int] | None:
        """(n, start): the longest suffix of suffix_source seen earlier, and where its latest
        occurrence's continuation starts (with ``before``: the latest starting there or earlier,
        among the ``occurrences`` most recent); None if none."""
        for n in range(min(self.max_n, len(suffix_source)), self.min_n - 1, -1):
            key = tuple(suffix_source[-n:])
            if before is None:
                start = self._latest.get(key)
            else:
                start = next((place for place in self._recent.get(key, ()) if place <= before), None)
            if start is not None:
                return n, start
        return None

    def lookup(self, suffix_source: list[int], limit: int) -> list[int]:
        """Continuation (up to limit tokens) of the longest suffix of suffix_source seen earlier."""
        found = self.find(suffix_source)
        return [] if found is None else self.tokens[found[1] : found[1] + limit]


    def lookup_tree(self, limit: int, budget: int) -> tuple[list[int], list[int]]:
        """The continuations (up to limit tokens) of the recent occurrences of the longest
        matching suffix, merged into a tree of at most ``budget`` nodes: (tokens, parents)."""
        for n in range(min(self.max_n, len(self.tokens)), self.min_n - 1, -1):
            starts = self._recent.get(tuple(self.tokens[-n:]))
            if starts:
                return merge_branches([self.tokens[s : s + limit] for s in starts], budget)
        return [], []


def merge_branches(branches: list[list[int]], budget: int) -> tuple[list[int], list[int]]:
    """Chains of tokens merged into one tree (shared prefixes once), earlier chains first, at
    most ``budget`` nodes: (tokens, parents) with parents before children."""
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for branch in branches:
        parent = -1
        for token in branch:
            node = index.get((parent, token))
            if node is None:
                if len(tokens) >= budget:
                    break
                node = index[(parent, token)] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            parent = node
    return tokens, parents


class NGramDrafter(BaseDrafter):
    """Drafter protocol around an NGramIndex of each request's verified context."""


    def __init__(self, max_n: int = 4, min_n: int = 1, branches: int = 1, budget: int = 16) -> None:
        NGramIndex(max_n, min_n)  # checks the sizes now, not at the first request
        self.max_n, self.min_n = max_n, min_n
        # branches > 1: a tree of the continuations of that many recent occurrences (budget nodes)
        self.branches, self.budget = branches, budget

    def describe(self) -> str:
        grams = f"{self.min_n}-{self.max_n}-grams"
        return f"n-gram lookup ({grams})" if self.branches == 1 else \
            f"n-gram tree ({grams}, {self.branches} branches, up to {self.budget} nodes)"

    def start(self, prompt_ids: torch.Tensor) -> NGramIndex:
        index = NGramIndex(self.max_n, self.min_n, occurrences=self.branches)
        index.extend(prompt_ids.tolist())
        return index

    def observe(self, request: DraftRequest, outcome: StepOutcome) -> None:
        request.draft_state.extend(outcome.emitted.tolist())

    def propose(self, request: DraftRequest, gamma: int) -> Draft:
        index: NGramIndex = request.draft_state
        device = request.context.device
        if gamma <= 0:
            return Draft.empty(device)
        if self.branches > 1:  # deterministic guesses: verified as point masses, lossless
            tokens, parents = index.lookup_tree(gamma, request.node_budget or self.budget)
            if not tokens:
                return Draft.empty(device)
            return Draft(torch.tensor(tokens, dtype=torch.long, device=device), None, tuple(parents))
        return Draft(torch.tensor(index.lookup(index.tokens, gamma), dtype=torch.long, device=device))
