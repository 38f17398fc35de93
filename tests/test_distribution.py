"""Speculative sampling keeps the target's distribution exactly (p = target, q = draft)."""

import itertools

import numpy as np
import pytest
import torch
from law import assert_matches_law, sample_sequences
from scipy.stats import chisquare
from table_lm import table_model

from specdec import SamplingParams, SpeculativeDecoder, logits_to_probs, make_drafter, rejection_sample
from specdec.core.policy import POLICIES
from specdec.core.verify import acceptance_probs, residual_distribution


def random_dist(generator, *shape, sharpness=2.0):
    return (sharpness * torch.randn(*shape, generator=generator, dtype=torch.float64)).softmax(-1)


@pytest.mark.parametrize("seed", range(20))
def test_first_token_law_is_exactly_p(seed):
    """P(first = y) = sum_x q(x) [a(x) 1{y = x} + (1 - a(x)) r(y)], computed from the sampler's
    own acceptance and residual functions, equals p(y)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = 7
    q = random_dist(generator, vocab)
    p = random_dist(generator, vocab)
    if seed % 4 == 0:  # include zeros in both supports
        q[:2] = 0
        p[-2:] = 0
        q, p = q / q.sum(), p / p.sum()
    law = torch.zeros(vocab, dtype=torch.float64)
    residual = residual_distribution(q[None], p[None])[0]
    for x in range(vocab):
        if q[x] == 0:
            continue
        accept = acceptance_probs(torch.tensor([x]), q[None], torch.stack([p, p]))[0]
        law[x] += q[x] * accept
        law += q[x] * (1 - accept) * residual
    torch.testing.assert_close(law, p, atol=1e-12, rtol=0)


@pytest.mark.slow
def test_first_token_empirical_law_matches_p():
    generator = torch.Generator().manual_seed(11)
    vocab, gamma, samples = 6, 3, 20000
    q = random_dist(generator, gamma, vocab)
    p = random_dist(generator, gamma + 1, vocab)
    counts = np.zeros(vocab)
    for _ in range(samples):
        draft = torch.multinomial(q, 1, generator=generator)[:, 0]
        counts[int(rejection_sample(draft, q, p, generator)[0])] += 1
    assert chisquare(counts, samples * p[0].numpy()).pvalue > 1e-3


def test_equal_p_and_q_accepts_every_draft():
    generator = torch.Generator().manual_seed(3)
    for _ in range(200):
        probs = random_dist(generator, 6, 9)
        draft = torch.multinomial(probs[:5], 1, generator=generator)[:, 0]
        emitted = rejection_sample(draft, probs[:5], probs, generator)
        assert emitted.shape[0] == 6 and torch.equal(emitted[:5], draft)


def test_disjoint_supports_always_reject():
    generator = torch.Generator().manual_seed(4)
    for _ in range(200):
        q = torch.zeros(4, 8, dtype=torch.float64)
        q[:, :4] = random_dist(generator, 4, 4)
        p = torch.zeros(5, 8, dtype=torch.float64)
        p[:, 4:] = random_dist(generator, 5, 4)
        draft = torch.multinomial(q, 1, generator=generator)[:, 0]
        emitted = rejection_sample(draft, q, p, generator)
        assert emitted.shape[0] == 1 and int(emitted[0]) >= 4


@pytest.mark.slow
def test_point_mass_draft_without_q():
    """A deterministic drafter (q = None) is accepted with probability p(x)."""
    generator = torch.Generator().manual_seed(5)
    p = random_dist(generator, 2, 5)
    accepted = sum(
        rejection_sample(torch.tensor([2]), None, p, generator).shape[0] == 2 for _ in range(20000)
    )
    assert abs(accepted / 20000 - float(p[0, 2])) < 0.015


def exact_sequence_law(target, prompt, length, sampling):
    """Enumerate every continuation of the table model: P(x_1..x_n) = prod p(x_i | prefix)."""
    vocab = target.vocab_size
    law = {}
    for sequence in itertools.product(range(vocab), repeat=length):
        probability, prefix = 1.0, list(prompt)
        for token in sequence:
            step = logits_to_probs(target.network.logits(prefix)[None], sampling)[0]
            probability *= float(step[token])
            prefix.append(token)
        law[sequence] = probability
    return law


SAMPLING_CASES = {
    "plain": SamplingParams(temperature=1.0),
    "temperature": SamplingParams(temperature=0.7),
    "top-k": SamplingParams(temperature=1.0, top_k=3),
    "top-p": SamplingParams(temperature=1.2, top_p=0.8),
    "min-p": SamplingParams(temperature=1.0, min_p=0.15),
}


DRAFTERS = ("model", "ngram", "staged")
PROMPT = [1, 2, 3, 1, 2, 3, 1]  # repeats, so that n-gram lookup proposes something


def table_drafter(kind: str, vocab: int):
    return make_drafter(kind, table_model(vocab, seed=101, sharpness=1.0), max_n=2)


# Every drafter with every policy; the sampling kinds rotate over the combinations so that each
# drafter meets four of the five and every kind is met by several drafters.
COMBINATIONS = [
    (drafter, policy, list(SAMPLING_CASES)[(i + j) % len(SAMPLING_CASES)])
    for i, drafter in enumerate(DRAFTERS) for j, policy in enumerate(POLICIES)
]


@pytest.mark.slow
@pytest.mark.parametrize("drafter_kind, policy, case", COMBINATIONS)
def test_end_to_end_law_of_three_tokens(drafter_kind, policy, case):
    """Chi-square of 20k seeded 3-token generations against the enumerated target law (in batches of
    100 requests, each with its own seed: a seeded sample is the same alone or in any batch)."""
    vocab, length, samples = 6, 3, 20000
    sampling = SAMPLING_CASES[case]
    target = table_model(vocab, seed=100)
    decoder = SpeculativeDecoder(target, table_drafter(drafter_kind, vocab), gamma=2, policy=policy)
    law = exact_sequence_law(target, PROMPT, length, sampling)
    counts, accepted, drafted = sample_sequences(decoder, PROMPT, sampling, length, samples)
    assert 0 < accepted < drafted  # speculation really happened, with rejections
    assert_matches_law(counts, law, f"{drafter_kind} {policy} {case}")


def test_end_to_end_law_of_two_tokens():
    """The fast tier's sampled law end to end: chi-square of 2k seeded 2-token generations with a
    draft model (fixed policy, temperature 1) against the enumerated target law (p = 0.43); the
    slow tier runs 20k 3-token samples for every drafter, policy and sampling kind. Mutations:
    rejection_sample_ragged accepting every draft (uniforms < 2) gives p = 0.0, and its
    rejection drawing from p instead of the residual norm(max(0, p - q)) gives p = 2e-34."""
    vocab, length, samples = 6, 2, 2000
    sampling = SAMPLING_CASES["plain"]
    target = table_model(vocab, seed=100)
    decoder = SpeculativeDecoder(target, table_drafter("model", vocab), gamma=2, policy="fixed")
    counts, accepted, drafted = sample_sequences(decoder, PROMPT, sampling, length, samples)
    assert 0 < accepted < drafted  # speculation really happened, with rejections
    assert_matches_law(counts, exact_sequence_law(target, PROMPT, length, sampling), "model fixed plain")


@pytest.mark.parametrize("drafter_kind", DRAFTERS)
def test_greedy_table_speculation_equals_target_only(drafter_kind):
    target = table_model(6, seed=100)
    baseline = SpeculativeDecoder(target)
    for policy in POLICIES:
        decoder = SpeculativeDecoder(target, table_drafter(drafter_kind, 6), gamma=3, policy=policy)
        for start in range(6):
            prompt = [start, *PROMPT]
            assert decoder.generate(prompt, max_new_tokens=20).token_ids == \
                baseline.generate(prompt, max_new_tokens=20).token_ids, (drafter_kind, policy)
