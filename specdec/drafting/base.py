"""The one narrow interface every drafter implements, and the hand-off it returns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specdec.sampling import SamplingParams


@dataclass(frozen=True)
class Draft:
    """Proposed continuation. probs is q at each drafted position (p = target, q = draft, as in
    Leviathan et al. 2023, Algorithm 1); None means the drafter is deterministic (point masses),
    or decoding is greedy and verification needs no q."""

    tokens: torch.Tensor  # [gamma] int64
    probs: torch.Tensor | None = None  # [gamma, vocab]

    @property
    def gamma(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> Draft:
        return Draft(torch.empty(0, dtype=torch.long, device=device))


@runtime_checkable
class Drafter(Protocol):
    """propose / observe / reset. A drafter changes speed, never output: any tokens it proposes
    are verified against the target."""

    #: The vocabulary its q ranges over (None for drafters with no q, such as n-gram lookup).
    vocab_size: int | None

    def reset(self) -> None:
        """Forget the previous sequence (called at the start of every generation)."""

    def propose(
        self,
        context: torch.Tensor,  # [n] int64: the prompt and every token emitted so far
        gamma: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
        stop_early: Callable[[int, float], bool] | None = None,
    ) -> Draft:
        """Up to gamma tokens continuing context. When sampling, tokens must be drawn from the
        returned probs (or be deterministic with probs None), or verification is not lossless.
        stop_early(drafted, chain_probability) -> True lets a policy cut a draft short; drafters
        without a probability for their guesses ignore it."""

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """Feedback after verification: how many of the proposed tokens the target kept."""
