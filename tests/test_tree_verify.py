"""Verification of token trees keeps the target's law (p = target, q = draft).

Mutation check, done by hand when this file was written: making `sibling_rejection_step` return
q unchanged after a rejection (the with-replacement rule) made
test_first_token_law_of_sibling_draws_is_exactly_p and the end-to-end law test fail.
"""

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.core.verify import greedy_tree_verify, rejection_sample, sibling_rejection_step, tree_rejection_sample


def random_dist(generator, *shape, sharpness=2.0):
    return (sharpness * torch.randn(*shape, generator=generator, dtype=torch.float64)).softmax(-1)


def draws_without_replacement(q: torch.Tensor, count: int):
    """Every ordered draw of `count` distinct tokens from q, with its probability."""
    for tokens in itertools.permutations(range(q.shape[0]), count):
        probability, left = 1.0, 1.0
        for token in tokens:
            probability *= float(q[token]) / left
            left -= float(q[token])
        if probability > 0:
            yield tokens, probability


@pytest.mark.parametrize("siblings", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", range(6))
def test_first_token_law_of_sibling_draws_is_exactly_p(siblings, seed):
    """P(first emitted = y), summed over every sibling draw, composed from the sampler's own
    step function, equals p(y)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = 6
    q, p = random_dist(generator, vocab), random_dist(generator, vocab)
    if seed % 3 == 0:  # zeros in both supports
        q[:2], p[-1] = 0, 0
        q, p = q / q.sum(), p / p.sum()
    law = torch.zeros(vocab, dtype=torch.float64)
    for tokens, probability in draws_without_replacement(q, min(siblings, int((q > 0).sum()))):
        reach, p_now, q_now = probability, p, q
        for token in tokens:
            accept, p_rejected, q_rejected = sibling_rejection_step(p_now, q_now, token)
            law[token] += reach * accept
            reach = reach * (1 - accept)
            p_now, q_now = p_rejected, q_rejected
        law += reach * p_now
    torch.testing.assert_close(law, p, atol=1e-12, rtol=0)


def empirical_first_tokens(tree_tokens_fn, parents, q_rows, p_rows, samples, seed):
    generator = torch.Generator().manual_seed(seed)
    counts = np.zeros(p_rows.shape[-1])
    for _ in range(samples):
        emitted, _ = tree_rejection_sample(tree_tokens_fn(generator), parents, q_rows, p_rows, generator)
        counts[int(emitted[0])] += 1
    return counts


@pytest.mark.parametrize("guesses", [False, True])
def test_a_chain_walked_as_a_tree_draws_what_the_chain_sampler_draws(guesses):
    """One sampler for chains and trees: a chain given as a tree (parents -1, 0, 1, ...) emits, seed
    for seed, what rejection_sample emits, with q and with guesses (point masses). (Checked: main's
    tree_rejection_sample before the one sampler, which drew a uniform per sibling as it went and
    guesses in float64, fails this.)"""
    generator = torch.Generator().manual_seed(8)
    vocab = 5
    for trial in range(200):
        gamma = trial % 5
        q, p = random_dist(generator, gamma, vocab), random_dist(generator, gamma + 1, vocab)
        draft = torch.multinomial(q, 1, generator=generator)[:, 0] if gamma else torch.zeros(0, dtype=torch.long)
        tree_q = None if guesses else torch.cat([q, torch.zeros(1, vocab, dtype=torch.float64)])
        chain = rejection_sample(draft, None if guesses else q, p, torch.Generator().manual_seed(trial))
        tree, path = tree_rejection_sample(draft, list(range(-1, gamma - 1)), tree_q, p,
                                           torch.Generator().manual_seed(trial))
        assert tree.tolist() == chain.tolist() and path.tolist() == list(range(chain.shape[0] - 1)), trial


@pytest.mark.slow
def test_a_chain_has_rejection_samples_law():
    """On a chain, the tree sampler's law of (accepted count, first token) is rejection_sample's."""
    generator = torch.Generator().manual_seed(1)
    vocab, gamma, samples = 5, 3, 20000
    q, p = random_dist(generator, gamma, vocab), random_dist(generator, gamma + 1, vocab)
    tree_q = torch.cat([q, torch.zeros(1, vocab, dtype=torch.float64)])  # row i + 1 = q at node i
    outcomes = {"chain": np.zeros((gamma + 1, vocab)), "tree": np.zeros((gamma + 1, vocab))}
    for _ in range(samples):
        draft = torch.multinomial(q, 1, generator=generator)[:, 0]
        chain = rejection_sample(draft, q, p, generator)
        tree, path = tree_rejection_sample(draft, [-1, 0, 1], tree_q, p, generator)
        assert path.tolist() == list(range(tree.shape[0] - 1))
        outcomes["chain"][chain.shape[0] - 1, int(chain[-1])] += 1
        outcomes["tree"][tree.shape[0] - 1, int(tree[-1])] += 1
    chain, tree = outcomes["chain"].ravel(), outcomes["tree"].ravel()
    keep = (chain + tree) > 0
    table = np.stack([chain[keep], tree[keep]])
    expected = table.sum(0) / 2
    assert chisquare(table[1], expected).pvalue > 1e-3


@pytest.mark.slow
def test_first_token_of_a_sampled_tree_is_p_empirically():
    """Two levels, three root children drawn without replacement, children under the first."""
    generator = torch.Generator().manual_seed(2)
    vocab = 6
    q_rows, p_rows = random_dist(generator, 5, vocab), random_dist(generator, 5, vocab)
    parents = [-1, -1, -1, 0]

    def draw(gen):
        roots = torch.multinomial(q_rows[0], 3, replacement=False, generator=gen)
        child = torch.multinomial(q_rows[1], 1, generator=gen)
        return torch.cat([roots, child])

    counts = empirical_first_tokens(draw, parents, q_rows, p_rows, 20000, seed=3)
    assert chisquare(counts, 20000 * p_rows[0].numpy()).pvalue > 1e-3


@pytest.mark.slow
def test_deterministic_siblings_are_lossless():
    generator = torch.Generator().manual_seed(4)
    p_rows = random_dist(generator, 4, 6)
    counts = empirical_first_tokens(lambda gen: torch.tensor([4, 1, 2]), [-1, -1, 0], None, p_rows, 20000, seed=5)
    assert chisquare(counts, 20000 * p_rows[0].numpy()).pvalue > 1e-3


@pytest.mark.slow
def test_edge_cases():
    generator = torch.Generator().manual_seed(6)
    p = random_dist(generator, 3, 5)
    # q == p at the root: the first child is always accepted
    for _ in range(50):
        tokens = torch.multinomial(p[0], 2, replacement=False, generator=generator)
        emitted, path = tree_rejection_sample(tokens, [-1, -1], p, p, generator)
        assert path.tolist() == [0] and int(emitted[0]) == int(tokens[0])
    # disjoint supports: every child rejected, the target's own token from outside q's support
    q = torch.zeros(3, 5, dtype=torch.float64)
    q[:, :2] = 0.5
    p_disjoint = torch.zeros(3, 5, dtype=torch.float64)
    p_disjoint[:, 2:] = 1 / 3
    for _ in range(50):
        emitted, path = tree_rejection_sample(torch.tensor([0, 1]), [-1, -1], q, p_disjoint, generator)
        assert path.numel() == 0 and int(emitted[0]) >= 2
    # q one-hot on a token p likes: accepted with probability p(x)
    one_hot = torch.zeros(2, 5, dtype=torch.float64)
    one_hot[0, 3] = 1.0
    accepted = sum(tree_rejection_sample(torch.tensor([3]), [-1], one_hot, p[:2], generator)[1].numel()
                   for _ in range(20000))
    assert abs(accepted / 20000 - float(p[0, 3])) < 0.015


def test_greedy_tree_verify_follows_the_argmax():
    vocab = 5
    logits = torch.full((6, vocab), -1.0)
    # root argmax 2, after node 1 (token 2) argmax 4, after node 3 (token 4) argmax 0
    for row, best in [(0, 2), (1, 1), (2, 4), (3, 3), (4, 0), (5, 1)]:
        logits[row, best] = 1.0
    tree = torch.tensor([1, 2, 3, 4, 0])  # nodes 0, 1 under the root; 2, 3 under node 1; 4 under 3
    emitted, path = greedy_tree_verify(tree, [-1, -1, 1, 1, 3], logits)
    assert path.tolist() == [1, 3, 4] and emitted.tolist() == [2, 4, 0, 1]
    emitted, path = greedy_tree_verify(torch.tensor([0, 1]), [-1, -1], logits[:3])
    assert path.tolist() == [] and emitted.tolist() == [2]


def test_tree_arguments_are_checked():
    with pytest.raises(ValueError, match="a tree of 2 nodes needs 2 parents and 3 rows"):
        tree_rejection_sample(torch.tensor([1, 2]), [-1], None, torch.rand(3, 4))
