"""Suffix decoding (Oliaro et al. 2024, "SuffixDecoding"): guesses copied from text seen before, in
this request (its prompt and output) and in earlier requests' outputs, kept in a bounded cache that
every request of one drafter shares.

The longest suffix of the context (up to ``max_n`` tokens) that occurred before is looked up; the
continuations of its most recent occurrences are merged into a trie with a count per node; the
draft is the most frequent path (``suffix``) or the most frequent nodes under a node budget
(``suffix-tree``), as deep as the match is long times ``depth_per_match`` (a long match is a
confident one). Guesses are deterministic: verified as point masses, lossless when sampling.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from specdec.core.drafts import (
    BaseDrafter,
    Draft,
    Drafter,
    DraftRequest,
    ReadsHidden,
    StepOutcome,
    describe_drafter,
    propose_many,
    suffix_caches,
)
from specdec.drafting.merge import SubRequest


class SuffixIndex:
    """Token sequences, and for every n-gram (min_n <= n <= max_n) of them where its continuation
    starts: (sequence id, position), the ``max_occurrences`` most recent. Sequences grow at their
    end (``extend``) and leave whole (``drop``)."""

    def __init__(self, max_n: int, min_n: int = 1, max_occurrences: int = 32) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n, self.max_occurrences = max_n, min_n, max_occurrences
        self.sequences: dict[int, list[int]] = {}
        self.occurrences: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        self._indexed: dict[int, int] = {}  # sequence -> n-grams ending before this position are indexed
        self.total_tokens = 0

    def extend(self, sequence: int, tokens: list[int]) -> None:
        stored = self.sequences.setdefault(sequence, [])
        stored.extend(tokens)
        self.total_tokens += len(tokens)
        start = self._indexed.get(sequence, 0)
        # An n-gram ending at the last token has no continuation yet: indexed when the next arrives.
        for end in range(start, len(stored) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                places = self.occurrences.setdefault(tuple(stored[end - n + 1 : end + 1]), [])
                places.append((sequence, end + 1))
                if len(places) > self.max_occurrences:
                    del places[0]
        self._indexed[sequence] = max(start, len(stored) - 1)

    def drop(self, sequence: int) -> None:
        stored = self.sequences.pop(sequence, [])
        self.total_tokens -= len(stored)
        for end in range(self._indexed.pop(sequence, 0)):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                key = tuple(stored[end - n + 1 : end + 1])
                places = [place for place in self.occurrences.get(key, []) if place[0] != sequence]
                if places:
                    self.occurrences[key] = places
                else:
                    self.occurrences.pop(key, None)

    def match(self, context: list[int], limit: int, exclude: int | None = None) -> tuple[int, list[list[int]]]:
        """The length of the longest suffix of ``context`` seen here (0: none), and the
        continuations (up to ``limit`` tokens each) of its occurrences, newest first; occurrences
        in sequence ``exclude`` do not count."""
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            places = [place for place in self.occurrences.get(tuple(context[-n:]), ()) if place[0] != exclude]
            if places:
                return n, [self.sequences[sequence][start : start + limit] for sequence, start in reversed(places)]
        return 0, []


class SuffixCache:
    """Earlier requests' outputs (each with the last prompt tokens before it, so a request's first
    tokens can match), at most ``max_tokens`` tokens: the oldest sequences leave first. Shared by
    every request of a drafter; ``max_tokens=0`` turns it off."""

    def __init__(self, max_tokens: int = 100_000, max_n: int = 6, min_n: int = 1) -> None:
        self.max_tokens = max_tokens
        self.index = SuffixIndex(max_n, min_n)
        self._order: OrderedDict[int, None] = OrderedDict()  # sequences, oldest first
        self._next_id = 0

    @property
    def size_tokens(self) -> int:
        return self.index.total_tokens

    def new_sequence(self, prompt_tail: list[int]) -> int | None:
        if self.max_tokens <= 0:
            return None
        sequence, self._next_id = self._next_id, self._next_id + 1
        self._order[sequence] = None
        self.append(sequence, prompt_tail)
        return sequence

    def clear(self) -> None:
        """Forget every earlier output (requests running now stop adding theirs)."""
        self.index = SuffixIndex(self.index.max_n, self.index.min_n)
        self._order.clear()

    @property
    def next_sequence(self) -> int:
        """The id the next request's sequence gets: a mark for ``forget_since``."""
        return self._next_id

    def forget_since(self, mark: int) -> None:
        """Drop the sequences begun at or after ``mark`` (a benchmark's repeat of a prompt then
        finds the cache as the first run found it, not holding that run's own output)."""
        for sequence in [sequence for sequence in self._order if sequence >= mark]:
            del self._order[sequence]
            self.index.drop(sequence)

    def append(self, sequence: int | None, tokens: list[int]) -> None:
        if sequence is None or sequence not in self._order:  # off, or evicted
            return
        self.index.extend(sequence, tokens)
        while self.index.total_tokens > self.max_tokens and self._order:
            oldest, _ = self._order.popitem(last=False)
            self.index.drop(oldest)


@dataclass
class SuffixState:
    own: SuffixIndex  # this request's context, as sequence 0
    shared: int | None  # this request's sequence in the drafter's cache (None: cache off or full)

    @property
    def context(self) -> list[int]:
        return self.own.sequences[0]


def trie_draft(continuations: list[list[int]], budget: int, chain: bool, least: int = 1) -> list[tuple[int, ...]]:
    """Continuations merged into a trie; the root paths of the nodes of the most frequent path
    (chain) or of the ``budget`` most frequent nodes (parents before children: a node is never
    more frequent than its parent, and ties go to the shallower). A node found in fewer than
    ``least`` continuations is left out (a corpus drafter's confidence: its counts)."""
    counts: dict[tuple[int, ...], int] = {}
    for continuation in continuations:
        for end in range(1, len(continuation) + 1):
            prefix = tuple(continuation[:end])
            counts[prefix] = counts.get(prefix, 0) + 1
    if chain:
        best_child: dict[tuple[int, ...], tuple[int, tuple[int, ...]]] = {}  # node -> (count, child) of its best child
        for node, count in counts.items():
            if count >= least:
                best_child[node[:-1]] = max(best_child.get(node[:-1], (0, ())), (count, node))
        path: tuple[int, ...] = ()
        while len(path) < budget and path in best_child:
            path = best_child[path][1]
        return [path[:end] for end in range(1, len(path) + 1)]
    kept = [node for node, count in counts.items() if count >= least]
    return sorted(kept, key=lambda node: (-counts[node], len(node), node))[:budget]


def tree_of(paths: list[tuple[int, ...]]) -> tuple[list[int], list[int]]:
    """(tokens, parents) of nodes given by their root paths, parents listed before children."""
    node_of = {path: index for index, path in enumerate(paths)}
    return [path[-1] for path in paths], [node_of.get(path[:-1], -1) for path in paths]


@dataclass(frozen=True)
class SuffixMatch:
    """The longest suffix of a context seen before, and what followed it there (newest first)."""

    length: int  # 0: no match
    own: list[list[int]]  # continuations in this request's own text
    shared: list[list[int]]  # continuations in the cross-request cache


class SuffixDrafter(BaseDrafter):
    """``suffix`` (a chain) or ``suffix-tree`` (``tree=True``): see the module docstring. Its cache is
    not locked: one engine's thread uses it (the server's scheduler thread does). A request's output
    enters the cache as it is verified, before EOS or a stop string ends it: a few tokens past the
    end may stay there, which only costs a rejected guess."""

    def __init__(self, cache: SuffixCache | None = None, tree: bool = False, budget: int = 16, max_n: int = 6,
                 depth_per_match: float = 2.0) -> None:
        self.cache = cache if cache is not None else SuffixCache(max_n=max_n)
        self.tree, self.budget, self.max_n, self.depth_per_match = tree, budget, max_n, depth_per_match

    def describe(self) -> str:
        kind = f"suffix tree (up to {self.budget} nodes)" if self.tree else "suffix decoding"
        return f"{kind}, its own context and a cache of earlier outputs ({self.cache.max_tokens} tokens at most)"

    def start(self, prompt_ids: torch.Tensor) -> SuffixState:
        prompt = prompt_ids.tolist()
        own = SuffixIndex(self.max_n)
        own.extend(0, prompt)
        return SuffixState(own, self.cache.new_sequence(prompt[-self.max_n :]))

    def observe(self, request: DraftRequest, outcome: StepOutcome) -> None:
        state: SuffixState = request.draft_state
        emitted = outcome.emitted.tolist()
        state.own.extend(0, emitted)
        self.cache.append(state.shared, emitted)

    def suffix_caches(self) -> list[SuffixCache]:
        return [self.cache]

    def matches(self, state: SuffixState, limit: int) -> SuffixMatch:
        """The longest match of the context's suffix (own text or cache) and its continuations."""
        context = state.context
        own_length, own = state.own.match(context, limit)
        shared_length, shared = self.cache.index.match(context, limit, exclude=state.shared)
        length = max(own_length, shared_length)
        # The longest match wins; a tie pools both sources' continuations.
        return SuffixMatch(length, own if own_length == length else [], shared if shared_length == length else [])

    def propose(self, request: DraftRequest, gamma: int) -> Draft:
        if gamma <= 0:
            return Draft.empty(request.context.device)
        return self.draft(request, gamma, self.matches(request.draft_state, gamma))

    def draft(self, request: DraftRequest, gamma: int, match: SuffixMatch) -> Draft:
        """The draft from a match (``matches``)."""
        device = request.context.device
        if match.length == 0:
            return Draft.empty(device)
        depth = min(gamma, math.ceil(self.depth_per_match * match.length))
        own = [continuation[:depth] for continuation in match.own]
        shared = [continuation[:depth] for continuation in match.shared]
        budget = (request.node_budget or self.budget) if self.tree else depth
        paths = trie_draft(own + shared, budget, chain=not self.tree)
        if not paths:
            return Draft.empty(device)
        tokens, parents = tree_of(paths)
        # A node the request's own text also proposes is not owed to the cache.
        own_prefixes = {tuple(continuation[:end]) for continuation in own for end in range(1, len(continuation) + 1)}
        from_cache = tuple(path not in own_prefixes for path in paths) if shared else None
        as_tensor = torch.tensor(tokens, dtype=torch.long, device=device)
        return Draft(as_tensor, None, tuple(parents) if self.tree else None, from_cache=from_cache)


class SuffixFirstDrafter(BaseDrafter):
    """``suffix-or-X``: the suffix draft where the context's suffix matches earlier text for at least
    ``min_match`` tokens (copying: a long match is a confident guess and costs no forward), the
    other drafter's elsewhere (SAM-decoding's rule, Hu et al. 2024). The choice reads only the
    context, never the target's draws, so either draft is verified as usual: lossless."""

    def __init__(self, suffix: SuffixDrafter, fallback: Drafter, min_match: int = 4) -> None:
        self.suffix, self.fallback, self.min_match = suffix, fallback, min_match
        self.vocab_size = fallback.vocab_size
        self.hidden_layers = fallback.hidden_layers

    def describe(self) -> str:
        return (f"{self.suffix.describe()} where it matches {self.min_match}+ tokens, "
                f"else {describe_drafter(self.fallback)}")

    def start(self, prompt_ids: torch.Tensor) -> tuple[SuffixState, Any]:
        return self.suffix.start(prompt_ids), self.fallback.start(prompt_ids)

    def propose(self, request: DraftRequest, gamma: int) -> Draft:
        return self.propose_many([request], [gamma])[0]

    def propose_many(self, requests: Sequence[DraftRequest], gammas: Sequence[int]) -> list[Draft]:
        """The suffix drafts where they match; the other drafter's for the rest, in one call."""
        drafts: list[Draft | None] = []
        for request, gamma in zip(requests, gammas, strict=True):
            drafts.append(None)
            if gamma > 0:
                match = self.suffix.matches(request.draft_state[0], gamma)
                if match.length >= self.min_match:
                    draft = self.suffix.draft(SubRequest(request, request.draft_state[0]), gamma, match)
                    drafts[-1] = draft if draft.num_nodes else None
        rest = [index for index, draft in enumerate(drafts) if draft is None]
        fallback = propose_many(self.fallback, [SubRequest(requests[i], requests[i].draft_state[1]) for i in rest],
                                [gammas[i] for i in rest])
        for index, draft in zip(rest, fallback, strict=True):
            drafts[index] = draft
        return cast(list[Draft], drafts)

    def suffix_caches(self) -> list[SuffixCache]:
        return self.suffix.suffix_caches() + suffix_caches(self.fallback)

    def prefilled(self, request: DraftRequest, hidden: torch.Tensor) -> None:  # hidden [prompt - 1, features]
        cast(ReadsHidden, self.fallback).prefilled(SubRequest(request, request.draft_state[1]), hidden)

    def observe(self, request: DraftRequest, outcome: StepOutcome) -> None:
        suffix_state, fallback_state = request.draft_state
        self.suffix.observe(SubRequest(request, suffix_state), outcome)
        self.fallback.observe(SubRequest(request, fallback_state), outcome)
