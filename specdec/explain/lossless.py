"""The lossless demonstration: a recorded step's verification re-run with many seeds.

Whatever q is, the first token a step emits is distributed as p at the block's first position
(the target's processed distribution after the context): drafts drawn from q and accepted with
min(1, p/q), plus corrections drawn from norm(max(0, p - q)), add up to exactly p. (For one
fixed draft token this is not so: the law holds over the draft's draws, so every seed draws
the draft anew from the recorded q.) Histogram against p, and a chi-square test of the fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from scipy.stats import chisquare

from specdec.core.verify import rejection_sample, tree_rejection_sample
from specdec.explain.record import StepRecord

MIN_EXPECTED = 5.0  # chi-square's usual rule: every bin expects at least 5 draws


@dataclass(frozen=True)
class LosslessCheck:
    counts: torch.Tensor  # [vocab] int64: how often each token came first out of verification
    p: torch.Tensor  # [vocab]: the target's processed distribution at the step's first position
    seeds: int
    bins: list[int]  # tokens tested on their own; the rest is pooled into one bin
    statistic: float
    p_value: float


def first_position(record: StepRecord) -> tuple[list[int], list[int] | None]:
    """The step's tokens at the block's first draft position (a chain's first draft, a tree's
    root children) and their parents (None: a chain)."""
    if record.parents is None:
        return record.draft_tokens[:1], None
    roots = [node for node, parent in enumerate(record.parents) if parent == -1]
    return [record.draft_tokens[node] for node in roots], [-1] * len(roots)


def first_emitted_counts(record: StepRecord, seeds: int) -> torch.Tensor:  # [vocab] int64
    """For seeds 0..seeds-1: draw the first draft position's tokens from q as the drafter did
    (a tree's root children without replacement; guesses with no q are kept as they were), verify
    them against p with the library's own verifier, and count the first token emitted. Later
    draft positions cannot change which token comes first, so they are left out."""
    tokens, parents = first_position(record)
    p0 = record.p[0]
    q0 = None if record.q is None or not tokens else record.q[0]
    counts = torch.zeros(p0.shape[-1], dtype=torch.long)
    generator = torch.Generator()
    for seed in range(seeds):
        generator.manual_seed(seed)
        drawn = torch.tensor(tokens, dtype=torch.long) if q0 is None else \
            torch.multinomial(q0, len(tokens), replacement=False, generator=generator)
        if parents is None:  # the chain verifier; p after an accepted draft only feeds the second token
            q = None if q0 is None else q0[None]  # a step that drafted nothing: the target's own draw
            emitted = rejection_sample(drawn, q, p0.expand(len(tokens) + 1, -1), generator, validate=False)
        else:
            q = None if q0 is None else q0.expand(len(tokens) + 1, -1)
            emitted, _ = tree_rejection_sample(drawn, parents, q, p0.expand(len(tokens) + 1, -1), generator,
                                               validate=False)
        counts[int(emitted[0])] += 1
    return counts


def chi_square_against(counts: torch.Tensor, p: torch.Tensor) -> tuple[list[int], float, float]:
    """Pearson's chi-square of counts against p: tokens expecting >= MIN_EXPECTED draws are
    bins of their own, the others one pooled bin. (bins, statistic, p-value)"""
    total = int(counts.sum())
    expected = p.double() * total
    bins = [int(t) for t in torch.nonzero(expected >= MIN_EXPECTED).flatten()]
    observed_bins = [float(counts[t]) for t in bins]
    expected_bins = [float(expected[t]) for t in bins]
    rest_observed, rest_expected = total - sum(observed_bins), total - sum(expected_bins)
    if rest_expected >= MIN_EXPECTED or rest_observed > 0:
        observed_bins.append(rest_observed)
        expected_bins.append(max(rest_expected, 1e-12))
    if len(observed_bins) < 2:  # p is (nearly) a point mass: the fit is exact or it is not
        return bins, 0.0, 1.0 if rest_observed == 0 else 0.0
    scale = sum(observed_bins) / sum(expected_bins)  # float rounding of p: make the totals agree exactly
    result = chisquare(observed_bins, [e * scale for e in expected_bins])
    return bins, float(result.statistic), float(result.pvalue)


def check_lossless(record: StepRecord, seeds: int = 5000) -> LosslessCheck:
    if record.greedy:
        raise ValueError("the lossless demonstration needs sampling (--temperature > 0): greedy emits the argmax")
    if seeds < 100:
        raise ValueError(f"--seeds must be at least 100 for a histogram, got {seeds}")
    counts = first_emitted_counts(record, seeds)
    p = record.p[0].double()
    bins, statistic, p_value = chi_square_against(counts, p)
    return LosslessCheck(counts, p, seeds, bins, statistic, p_value)
