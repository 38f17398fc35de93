"""The one-pass verifiers of a ragged batch against a batch of one: the same tokens and paths for
every request of random batches of chains and trees (greedy, specdec/core/verify_batch.py), the same
samples from the same generators (the one rejection sampler, specdec/core/verify.py, chains and trees),
the target's law per row of a batch (chi-square), and the engine's step verified in one pass."""

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from specdec.core.drafts import Draft
from specdec.core.rules import CoupledRule, RejectionRule
from specdec.core.sampling import SamplingParams
from specdec.core.verify import (
    RaggedDrafts,
    greedy_tree_verify_tokens,
    greedy_verify_tokens,
    rejection_sample,
    rejection_sample_ragged,
    tree_rejection_sample,
)
from specdec.core.verify_batch import greedy_verify_ragged, verify_request, verify_step

VOCAB = 5  # small, so that drafts often match and siblings often repeat a token


@st.composite
def drafted_block(draw):
    """(tokens [n], parents or None for a chain, target argmax [n + 1])."""
    count = draw(st.integers(0, 7))
    tree = draw(st.booleans())
    parents = [draw(st.integers(-1, index - 1)) for index in range(count)] if tree else None
    tokens = torch.tensor(draw(st.lists(st.integers(0, VOCAB - 1), min_size=count, max_size=count)), dtype=torch.long)
    argmax = torch.tensor(draw(st.lists(st.integers(0, VOCAB - 1), min_size=count + 1, max_size=count + 1)))
    return tokens, parents, argmax


@settings(max_examples=300, deadline=None)
@given(st.lists(drafted_block(), min_size=1, max_size=6))
def test_greedy_ragged_equals_request_by_request(blocks):
    """Every request's emitted tokens and accepted path equal greedy_verify_tokens (chains) and
    greedy_tree_verify_tokens (trees, repeated sibling tokens included)."""
    offsets = [0]
    for tokens, _, _ in blocks:
        offsets.append(offsets[-1] + tokens.shape[0] + 1)
    results = greedy_verify_ragged([tokens for tokens, _, _ in blocks], [parents for _, parents, _ in blocks],
                                   torch.cat([argmax for _, _, argmax in blocks]), offsets)
    for (tokens, parents, argmax), (emitted, path) in zip(blocks, results, strict=True):
        if parents is None:
            assert emitted.tolist() == greedy_verify_tokens(tokens, argmax).tolist()
            assert path == list(range(len(path)))
        else:
            expected, expected_path = greedy_tree_verify_tokens(tokens, parents, argmax)
            assert (emitted.tolist(), path) == (expected.tolist(), expected_path.tolist())


def test_greedy_ragged_follows_the_first_of_repeated_siblings():
    """Siblings 0 and 1 both hold the target's token; 1 has a matching child, 0 none. Request by
    request the first sibling is taken and the path ends there; so it must here (a chain beside it).
    (A vectorized version of this pass once missed it: its deepest accepted node went through node 1.)"""
    tree = torch.tensor([2, 2, 3])
    argmax = torch.tensor([2, 4, 3, 0])  # root -> 2; after node 0 -> 4; after node 1 -> 3; after node 2 -> 0
    chain, chain_argmax = torch.tensor([1, 1]), torch.tensor([1, 0, 3])
    (chain_emitted, _), (emitted, path) = greedy_verify_ragged([chain, tree], [None, (-1, -1, 1)],
                                                               torch.cat([chain_argmax, argmax]), [0, 3, 7])
    assert (emitted.tolist(), path) == ([2, 4], [0])
    assert chain_emitted.tolist() == [1, 0]


def random_probs(rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    weights = torch.rand(rows, vocab, generator=generator, dtype=torch.float64) ** 3
    return weights / weights.sum(-1, keepdim=True)


def test_rejection_ragged_draws_what_each_request_draws_alone():
    """The same seeds give every request of a batch the tokens rejection_sample gives it alone, for
    draft lengths 0-5 side by side, with q and with point masses. Mutation, checked: drawing
    every request's uniforms from the first request's generator fails."""
    source = torch.Generator().manual_seed(0)
    for trial in range(60):
        counts = [trial % 6, (trial * 7) % 4, 5, 0, (trial * 3) % 6][: 1 + trial % 5]
        vocab = 6
        q = [random_probs(count, vocab, source) for count in counts]
        tokens = [torch.multinomial(rows, 1, generator=source)[:, 0] if count else torch.zeros(0, dtype=torch.long)
                  for rows, count in zip(q, counts, strict=False)]
        p = [random_probs(count + 1, vocab, source) for count in counts]
        if trial % 3 == 0:  # like p in places, so that long prefixes get accepted
            p = [0.8 * target + 0.2 * torch.cat([rows, target[-1:]]) for rows, target in zip(q, p, strict=False)]
        point_mass = trial % 4 == 1
        seeds = [1000 * trial + index for index in range(len(counts))]
        alone = [rejection_sample(tokens[i], None if point_mass else q[i], p[i],
                                  torch.Generator().manual_seed(seeds[i])).tolist() for i in range(len(counts))]
        batched = rejection_sample_ragged(RaggedDrafts.of(tokens, [None] * len(counts)),
                                          [None if point_mass else rows for rows in q], torch.cat(p),
                                          [torch.Generator().manual_seed(seed) for seed in seeds])
        assert [emitted.tolist() for emitted, _ in batched] == alone, trial


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(drafted_block(), st.booleans(), st.integers(0, 2**31)), min_size=1, max_size=5))
def test_rejection_ragged_samples_trees_as_each_alone(blocks):
    """Chains and trees side by side, with q (per parent row, as drafters give it) and without
    (guesses): every request gets from its own seed what tree_rejection_sample (a chain:
    rejection_sample) gives it alone, sibling rejections included. Mutation, checked: starting an
    accepted node's p at its row within the request and not within the batch (no + r) fails."""
    source = torch.Generator().manual_seed(len(blocks))
    tokens, parents, node_q, p, alone = [], [], [], [], []
    for (draft, tree, _), guesses, seed in blocks:
        count = draft.shape[0]
        rows = None if guesses else random_probs(count + 1, VOCAB, source)  # q at the root, then after each node
        target = random_probs(count + 1, VOCAB, source)
        if tree is None:
            emitted = rejection_sample(draft, None if rows is None else rows[:count], target,
                                       torch.Generator().manual_seed(seed))
            alone.append((emitted.tolist(), list(range(emitted.shape[0] - 1))))
        else:
            emitted, path = tree_rejection_sample(draft, tree, rows, target, torch.Generator().manual_seed(seed))
            alone.append((emitted.tolist(), path.tolist()))
        tokens.append(draft)
        parents.append(tree)
        node_q.append(None if rows is None else rows[[parent + 1 for parent in (tree or range(-1, count - 1))]])
        p.append(target)
    batched = rejection_sample_ragged(RaggedDrafts.of(tokens, parents), node_q, torch.cat(p),
                                      [torch.Generator().manual_seed(seed) for _, _, seed in blocks])
    assert [(emitted.tolist(), path) for emitted, path in batched] == alone


def test_every_row_of_a_ragged_batch_has_the_targets_law():
    """The first emitted token of each of 3 requests (drafts of 0, 2 and 4 tokens from q != p)
    follows that request's p, over 6000 batched steps (chi-square, p-value > 1e-3)."""
    vocab, steps = 5, 6000
    source = torch.Generator().manual_seed(7)
    counts = [0, 2, 4]
    q = [random_probs(count, vocab, source) for count in counts]
    p = [random_probs(count + 1, vocab, source) for count in counts]
    generators = [torch.Generator().manual_seed(seed) for seed in (11, 12, 13)]
    firsts = torch.zeros(len(counts), vocab)
    for _ in range(steps):
        tokens = [torch.multinomial(rows, 1, generator=source)[:, 0] if count else torch.zeros(0, dtype=torch.long)
                  for rows, count in zip(q, counts, strict=False)]
        emitted = rejection_sample_ragged(RaggedDrafts.of(tokens, [None] * 3), q, torch.cat(p), generators)
        for index, (tokens_out, _) in enumerate(emitted):
            firsts[index, int(tokens_out[0])] += 1
    for index in range(len(counts)):
        expected = p[index][0].float() * steps
        assert chisquare(firsts[index], expected / expected.sum() * steps).pvalue > 1e-3, index


def test_verify_step_reads_a_narrow_view_of_a_request():
    """verify_step needs of a request only its sampling settings, rule, length and generator (no
    engine Request): plain namespaces with those four, greedy and sampled, chains and trees, the
    coupled rule and a lossy one among them, get each what verify_request gives it alone (the
    sampled ones from a fresh generator of the same seed). Mutation, checked: reading
    request.tokens in verify_step fails with AttributeError."""
    source = torch.Generator().manual_seed(3)
    settings_ = [SamplingParams(), SamplingParams(temperature=0.9), SamplingParams(temperature=0.9),
                 SamplingParams(temperature=0.9, acceptance="lossy"), SamplingParams(temperature=0.9)]
    parents = [None, (-1, -1, 0), None, None, (-1, 0)]
    coupled = [False, False, False, False, True]

    def views():
        generators = [torch.Generator().manual_seed(seed) for seed in range(len(settings_))]
        return [SimpleNamespace(sampling=sampling, length=7, generator=generator,
                                rule=CoupledRule(seed) if couple else RejectionRule(generator))
                for seed, (sampling, generator, couple) in enumerate(zip(settings_, generators, coupled, strict=False))]

    drafts = []
    for tree in parents:
        count = 3 if tree is None else len(tree)
        q = random_probs(count + 1, VOCAB, source)
        drafts.append(Draft(torch.multinomial(q[:count], 1, generator=source)[:, 0], q if tree else q[:count], tree))
    offsets = [0]
    for draft in drafts:
        offsets.append(offsets[-1] + draft.num_nodes + 1)
    logits = torch.randn(offsets[-1], VOCAB, generator=source)
    argmax = logits.argmax(-1)
    together = verify_step(views(), drafts, logits, argmax, offsets)
    alone = [verify_request(view, draft, logits[start:end], argmax[start:end])
             for view, draft, start, end in zip(views(), drafts, offsets, offsets[1:], strict=False)]
    for mine, theirs in zip(together, alone, strict=True):
        assert mine.emitted.tolist() == theirs.emitted.tolist() and mine.relaxed == theirs.relaxed
        assert (mine.path is None) == (theirs.path is None) and (mine.path is None or mine.path.equal(theirs.path))
