"""A chi-square check of sampled sequences against an enumerated law, shared by the law tests."""

import dataclasses
from collections import Counter

import numpy as np
from scipy.stats import chisquare


class StepClock:
    """A clock for the engine's cost model that advances 1 ms per reading. The cost policies choose
    draft lengths from measured seconds; with real timings a seeded law test drew different
    samples in every run (its p-value a fresh draw each time: one fell below 1e-3 in a CI run);
    with this clock the same seeds give the same samples, run after run."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-3
        return self.now


def assert_matches_law(counts: dict, law: dict, label: str = "") -> None:
    """counts: sequence -> times sampled; law: sequence -> exact probability."""
    samples = sum(counts.values())
    assert sum(counts.get(s, 0) for s in law if law[s] == 0) == 0, f"{label}: sampled an impossible sequence"
    support = [s for s in law if law[s] > 0]
    expected = np.array([law[s] for s in support])
    expected *= samples / expected.sum()  # a float32 law sums to 1 only up to ~1e-7
    observed = np.array([counts.get(s, 0) for s in support], dtype=float)
    # pool the rare cells so that every expected count is >= 5, as the chi-square test needs
    rare = expected < 5
    if rare.any():
        expected = np.append(expected[~rare], expected[rare].sum())
        observed = np.append(observed[~rare], observed[rare].sum())
    assert chisquare(observed, expected).pvalue > 1e-3, label


def sample_sequences(decoder, prompt: list[int], sampling, length: int, samples: int,
                     batch: int = 100, first_seed: int = 0) -> tuple[Counter, int, int]:
    """Seeds first_seed..first_seed+samples-1, generated in batches of `batch` requests (a seeded sample is the same
    alone or in any batch), with rejection sampling unless ``sampling`` names its rule (a seed
    alone would choose the coupled rule). Returns (sequence -> count, accepted draft tokens,
    drafted tokens)."""
    counts, accepted, drafted = Counter(), 0, 0
    rule = sampling.sampling_rule or "rejection"
    # The decoder's cost model (its engine's, and an auto drafter's: the same one) on the step clock.
    decoder.engine.costs.clock = StepClock()
    for first in range(first_seed, first_seed + samples, batch):
        settings = [dataclasses.replace(sampling, seed=seed, max_new_tokens=length, sampling_rule=rule)
                    for seed in range(first, min(first + batch, first_seed + samples))]
        for result in decoder.generate([prompt] * len(settings), settings):
            counts[tuple(result.token_ids)] += 1
            accepted += result.stats.accepted
            drafted += result.stats.drafted
    return counts, accepted, drafted
