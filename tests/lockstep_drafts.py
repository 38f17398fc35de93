"""Drafts of a batch against drafts alone: what lockstep drafting must not change (heads, draft models)."""

from __future__ import annotations

from collections.abc import Callable

from specdec import SamplingParams

#: Five prompts of different lengths (5, 8, .. 17 tokens) in a 96-token vocabulary.
PROMPTS = [[(start * 7 + i * 3) % 96 for i in range(5 + 3 * start)] for start in range(5)]


def drafts_after(engine, drafter, indices: list[int], steps: int, step: Callable | None = None) -> list:
    """The drafts (gamma 3, seeded, temperature 1) of PROMPTS[indices] decoded together: prefilled,
    ``steps`` engine steps (``step(requests, cache)`` instead of engine.step where given), then one
    propose_many for all."""
    cache = engine.target.new_cache(rows=len(indices))
    requests = [engine.new_request(PROMPTS[i], SamplingParams(temperature=1.0, seed=i, max_new_tokens=32), row)
                for row, i in enumerate(indices)]
    engine.prefill(requests, cache)
    for _ in range(steps):
        (step or engine.step)(requests, cache)
    return drafter.propose_many(requests, [3] * len(requests))
