"""Prompt lookup: propose what followed the most recent earlier occurrence of the context's
longest matching suffix. No model, no q (verification treats the guess as a point mass)."""

from __future__ import annotations

import torch

from specdec.drafting.base import Draft, DraftRequest, StepOutcome


class NGramIndex:
    """n-grams of a growing token sequence -> where the continuation of their latest occurrence
    starts. Updated incrementally as tokens arrive; never rescans the context."""

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self._latest: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in the index

    def reset(self) -> None:
        self.tokens.clear()
        self._latest.clear()
        self._indexed = 0

    def extend(self, new_tokens: list[int]) -> None:
        self.tokens.extend(new_tokens)
        # Index n-grams ending before the last token: the suffix itself must not match itself.
        for end in range(self._indexed, len(self.tokens) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self._latest[tuple(self.tokens[end - n + 1 : end + 1])] = end + 1
        self._indexed = max(self._indexed, len(self.tokens) - 1)

    def lookup(self, suffix_source: list[int], limit: int) -> list[int]:
        """Continuation (up to limit tokens) of the longest suffix of suffix_source seen earlier."""
        for n in range(min(self.max_n, len(suffix_source)), self.min_n - 1, -1):
            start = self._latest.get(tuple(suffix_source[-n:]))
            if start is not None:
                return self.tokens[start : start + limit]
        return []


class NGramDrafter:
    """Drafter protocol around an NGramIndex of each request's verified context."""

    vocab_size = None  # no q: any vocabulary
    wants_hidden = False

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        NGramIndex(max_n, min_n)  # checks the sizes now, not at the first request
        self.max_n, self.min_n = max_n, min_n

    def start(self, prompt_ids: torch.Tensor) -> NGramIndex:
        index = NGramIndex(self.max_n, self.min_n)
        index.extend(prompt_ids.tolist())
        return index

    def observe(self, request: DraftRequest, outcome: StepOutcome) -> None:
        request.draft_state.extend(outcome.emitted.tolist())

    def propose(self, request: DraftRequest, gamma: int) -> Draft:
        index: NGramIndex = request.draft_state
        guess = index.lookup(index.tokens, gamma) if gamma > 0 else []
        return Draft(torch.tensor(guess, dtype=torch.long, device=request.context.device))
