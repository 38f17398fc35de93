"""Sampling rules: how a sampled request draws tokens and judges drafts (p = target, q = draft).

Two lossless rules, each a pair of verbs (draw, verify) so that drafters and the engine never
branch on which one runs:

- ``rejection``: speculative sampling (Leviathan et al. 2023; Jeon et al. 2024 for trees) with
  the request's generator. Acceptance 1 - TV(p, q) per token, the best any rule can do; but how
  many uniforms a step draws depends on the draft, so the same seed gives another text with
  another drafter, gamma or policy.
- ``coupled``: drafter-invariant speculative sampling (Daliri, Musco and Suresh 2024). The token
  at output position t is the exponential race argmax_i p_i / E_{t,i} (Gumbel-max), with noise
  E_t ~ Exp(1)^vocab keyed by (seed, t) alone. The drafter proposes argmax q / E_t with the same
  noise, and a drafted token is accepted exactly when it equals the target's draw. The output is
  then exactly what the target alone samples with that seed, whatever drafted it, in any batch;
  its law is exactly p because E_t is independent of everything before position t. Acceptance
  is at least (1 - TV) / (1 + TV) per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from specdec.core.sampling import SAMPLING_RULES
from specdec.core.verify import greedy_verify_tokens, rejection_sample

if TYPE_CHECKING:
    from specdec.core.acceptance import Relaxation


class SamplingRule(Protocol):
    """How one sampled request draws tokens (drafter and target alike) and verifies drafts.
    ``positions`` are the output positions (indices in the request's token sequence) of the
    tokens being drawn: the coupled rule keys its noise on them, rejection sampling ignores them."""

    #: Whether verify needs the drafter's q (Draft.probs); the coupled rule compares tokens only.
    needs_draft_probs: bool
    #: Whether its drafts are verified with the batch's others in the rejection pass
    #: (verify.rejection_sample_ragged, with the request's own generator); else a draft is
    #: accepted where it equals the rule's draws, and joins the batch's greedy walk
    #: (verify_batch.verify_step: ``draw`` at each row's position, then verify.greedy_walk).
    ragged: bool

    def draw(
        self,
        probs: torch.Tensor,  # [n, vocab]
        positions: Sequence[int],  # [n]
    ) -> torch.Tensor:  # [n] int64, one token per row
        """One token from each row."""

    def draw_distinct(
        self,
        probs: torch.Tensor,  # [vocab]
        position: int,
        count: int,  # at most the number of tokens with positive probability
    ) -> torch.Tensor:  # [count] int64
        """``count`` tokens drawn one after another without replacement (siblings of a tree)."""

    def verify_chain(
        self,
        draft_tokens: torch.Tensor,  # [gamma] int64
        draft_probs: torch.Tensor | None,  # [gamma, vocab]; None = point masses
        target_probs: torch.Tensor,  # [gamma + 1, vocab]
        first_position: int,  # the output position of the first drafted token
        relaxation: Relaxation | None = None,  # LOSSY acceptance (specdec.core.acceptance); None: exact
    ) -> torch.Tensor:  # [n_accepted + 1]: accepted drafts, then the target's token
        ...


class RejectionRule:
    """Speculative sampling with one generator per request (torch.multinomial, uniforms)."""

    needs_draft_probs = True
    ragged = True

    def __init__(self, generator: torch.Generator | None) -> None:
        self.generator = generator

    def draw(self, probs: torch.Tensor, positions: Sequence[int]) -> torch.Tensor:
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0]

    def draw_distinct(self, probs: torch.Tensor, position: int, count: int) -> torch.Tensor:
        return torch.multinomial(probs, count, replacement=False, generator=self.generator)

    def verify_chain(self, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     first_position: int, relaxation: Relaxation | None = None) -> torch.Tensor:
        return rejection_sample(draft_tokens, draft_probs, target_probs, self.generator, False, relaxation)


MASK64 = (1 << 64) - 1


def noise_key(seed: int, position: int) -> int:
    """A 63-bit generator seed for (seed, position): two rounds of splitmix64's finaliser, so
    neighbouring positions and seeds give unrelated streams."""
    value = (seed * 0x9E3779B97F4A7C15 + position) & MASK64
    for _ in range(2):
        value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK64
        value ^= value >> 31
    return value >> 1


def position_exponentials(seed: int, position: int, vocab: int) -> torch.Tensor:  # [vocab] float64, on the CPU
    """E ~ Exp(1)^vocab keyed by (seed, position): the same numbers on every device and batch.
    float64 uniforms, so a zero (an infinite score) has probability 2^-53 per entry."""
    generator = torch.Generator().manual_seed(noise_key(seed, position))
    uniforms = torch.rand(vocab, generator=generator, dtype=torch.float64)
    return (-torch.log1p(-uniforms)).clamp_min_(torch.finfo(torch.float64).tiny)


class CoupledRule:
    """Drafter-invariant sampling: every draw at output position t is argmax probs / E_t."""

    needs_draft_probs = False
    ragged = False  # its draws are keyed by position, request by request
    #: Noise rows kept per request: a step draws for at most its tree's depth + 1 positions, and
    #: the next step starts where this one's accepted tokens end, so recent rows are reused.
    CACHED_POSITIONS = 64

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.noise: dict[tuple[int, int], torch.Tensor] = {}

    def exponentials(self, position: int, vocab: int, device: torch.device) -> torch.Tensor:  # [vocab] float64
        key = (position, vocab)
        if key not in self.noise:
            if len(self.noise) >= self.CACHED_POSITIONS:
                del self.noise[min(self.noise)]  # the oldest position: decoding moves forward
            self.noise[key] = position_exponentials(self.seed, position, vocab)
        return self.noise[key].to(device)

    def scores(self, probs: torch.Tensor, position: int) -> torch.Tensor:  # probs [vocab] -> [vocab] float64
        # The exponential race: P(argmax p_i / E_i = j) = p_j exactly; zero-probability tokens score 0.
        return probs.double() / self.exponentials(position, probs.shape[-1], probs.device)

    def draw(self, probs: torch.Tensor, positions: Sequence[int]) -> torch.Tensor:
        return torch.stack([self.scores(row, position).argmax()
                            for row, position in zip(probs, positions, strict=True)])

    def draw_distinct(self, probs: torch.Tensor, position: int, count: int) -> torch.Tensor:
        # Gumbel-top-k: the k best scores are k draws without replacement, best first (so the
        # first sibling is this position's draw, the one the target is coupled to).
        return self.scores(probs, position).topk(count).indices

    def verify_chain(self, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     first_position: int, relaxation: Relaxation | None = None) -> torch.Tensor:
        positions = range(first_position, first_position + target_probs.shape[0])
        return greedy_verify_tokens(draft_tokens, self.draw(target_probs, positions), relaxation)


def make_rule(name: str, seed: int, generator: torch.Generator) -> SamplingRule:
    """The rule ``name`` for a request with this seed (and the generator seeded from it)."""
    if name == "coupled":
        return CoupledRule(seed)
    if name == "rejection":
        return RejectionRule(generator)
    raise ValueError(f"unknown sampling rule {name!r}; known: {', '.join(SAMPLING_RULES)}")
