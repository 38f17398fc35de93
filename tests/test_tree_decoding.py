"""Decoding with token trees: greedy output equals target-only, sampled output has the target's
law (chi-square against the enumerated law), and the adapter refuses trees clearly."""


import pytest
from law import assert_matches_law, sample_sequences
from table_lm import table_model
from test_distribution import PROMPT, exact_sequence_law
from test_greedy_equality import DRAFT_KINDS, check_equality, lean_models  # noqa: F401 (fixture)

from specdec import SamplingParams, SpeculativeDecoder, load
from specdec.drafting import ModelTreeDrafter


@pytest.mark.slow
def test_tree_drafts_equal_target_only(lean_models):  # noqa: F811
    target, drafts = lean_models
    drafters = {kind: ModelTreeDrafter(drafts[kind], budget=8, branching=3) for kind in DRAFT_KINDS}
    counts = check_equality(target, drafters, "fixed")
    assert counts["same"][0] > 0
    # an independent draft is rarely right, a perturbed one often: trees really branch and get verified
    assert counts["independent"][0] < counts["perturbed"][0]


@pytest.mark.slow
def test_staged_tree_drafts_equal_target_only(lean_models):  # noqa: F811
    """The staged chain with the draft's next-best tokens as side leaves."""
    from specdec import make_drafter

    target, drafts = lean_models
    drafters = {kind: make_drafter("staged-tree", drafts[kind], max_n=3, tree_budget=12) for kind in DRAFT_KINDS}
    counts = check_equality(target, drafters, "fixed")
    assert counts["same"][0] > 0
    assert counts["independent"][0] < counts["perturbed"][0]


@pytest.mark.slow
def test_int8_tree_drafts_equal_int8_target_only(tiny_pair):
    target = load(tiny_pair["target"], quantize="int8")
    drafter = ModelTreeDrafter(load(tiny_pair["perturbed"], quantize="int8"), budget=8, branching=3)
    baseline, decoder = SpeculativeDecoder(target), SpeculativeDecoder(target, drafter, gamma=4)
    for start in range(20):
        prompt = [(start * 7 + i) % 96 for i in range(start % 9 + 1)]
        assert decoder.generate(prompt, max_new_tokens=24).token_ids == \
            baseline.generate(prompt, max_new_tokens=24).token_ids, prompt


@pytest.mark.slow
@pytest.mark.parametrize("kind, sampling", [("tree", SamplingParams(temperature=0.8, top_k=5)),
                                            ("staged-tree", SamplingParams(temperature=1.0, top_k=3))],
                         ids=["tree", "staged-tree"])
def test_tree_law_of_three_tokens(kind, sampling):
    """Trees of depth <= 3 and 1-3 children per node over a 6-token vocabulary; 20k seeded
    3-token generations against the enumerated target law, in batches of 100 seeded requests.
    Temperature and top-k apply on both sides (target and draft). Mutation, checked: staged-tree
    leaves taken as q's next-best tokens instead of drawn from it fails the staged-tree case."""
    from specdec import make_drafter

    vocab, length, samples = 6, 3, 20000
    target = table_model(vocab, seed=100)
    draft = table_model(vocab, seed=101, sharpness=1.0)
    # staged-tree: 3 levels of 3 nodes (the staged token and two leaves drawn after it)
    drafter = ModelTreeDrafter(draft, budget=6, branching=3) if kind == "tree" else make_drafter(kind, draft, max_n=2,
                                                                                                tree_budget=9)
    decoder = SpeculativeDecoder(target, drafter, gamma=3)
    law = exact_sequence_law(target, PROMPT, length, sampling)
    counts, accepted, drafted = sample_sequences(decoder, PROMPT, sampling, length, samples)
    assert 0 < accepted < drafted
    assert_matches_law(counts, law)


def test_trees_through_the_adapter_are_refused_clearly(tiny_pair):
    target = load(tiny_pair["target"], backend="transformers")
    decoder = SpeculativeDecoder(target, ModelTreeDrafter(load(tiny_pair["perturbed"]), budget=4))
    with pytest.raises(ValueError, match="use --backend specdec for token trees"):
        decoder.generate([1, 2, 3], max_new_tokens=8)


def test_tree_budget_and_branching_are_checked(tiny_pair):
    with pytest.raises(ValueError, match="budget >= 1 and branching >= 1"):
        ModelTreeDrafter(load(tiny_pair["target"]), budget=0)


def test_ngram_tree_worked_example():
    import torch

    from specdec.core.drafts import ContextRequest
    from specdec.drafting import NGramDrafter

    drafter = NGramDrafter(max_n=2, min_n=2, branches=4, budget=16)
    context = torch.tensor([1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2])
    draft = drafter.propose(ContextRequest.started(drafter, context), 3)
    # the continuations of the three earlier [1 2], newest first, merged where they share a prefix
    assert draft.tokens.tolist() == [5, 1, 2, 4, 1, 2, 3, 1, 2]
    assert draft.parents == (-1, 0, 1, -1, 3, 4, -1, 6, 7)
    small = NGramDrafter(max_n=2, min_n=2, branches=4, budget=4)
    assert small.propose(ContextRequest.started(small, context), 3).tokens.tolist() == [5, 1, 2, 4]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ngram-tree", "tree+ngram", "model+ngram-tree"])
def test_ngram_and_merged_trees_equal_target_only(lean_models, kind):  # noqa: F811
    from specdec import make_drafter

    target, drafts = lean_models
    drafters = {name: make_drafter(kind, drafts[name], max_n=3, tree_budget=10) for name in ("same", "perturbed")}
    counts = check_equality(target, drafters, "fixed")
    assert counts["same"][0] > 0


@pytest.mark.slow
def test_merged_tree_law_of_three_tokens():
    """A merged tree is verified with point masses: still the target's law."""
    from specdec import make_drafter

    vocab, length, samples = 6, 3, 10000
    sampling = SamplingParams(temperature=0.9)
    target = table_model(vocab, seed=100)
    drafter = make_drafter("model+ngram-tree", table_model(vocab, seed=101, sharpness=1.0), max_n=2, tree_budget=6)
    decoder = SpeculativeDecoder(target, drafter, gamma=3)
    law = exact_sequence_law(target, PROMPT, length, sampling)
    counts, _, _ = sample_sequences(decoder, PROMPT, sampling, length, samples)
    assert_matches_law(counts, law)


@pytest.mark.slow
def test_tree_stats_and_sources(lean_models):  # noqa: F811
    """Per-depth stats add up, and --show's sources say when a tree's other branch won."""
    from specdec import TokenSource

    target, drafts = lean_models
    decoder = SpeculativeDecoder(target, ModelTreeDrafter(drafts["perturbed"], budget=12, branching=3), gamma=4)
    sources, totals = [], {"nodes": 0, "drafted": 0}
    for start in range(30):
        chunks = list(decoder.stream([start, (start * 5) % 96, 7], max_new_tokens=20))
        stats = chunks[-1].result.stats
        sources += [s for chunk in chunks for s in chunk.sources]
        assert len(stats.drafted_at) <= 4 and 0 < stats.drafted_at[0] <= stats.target_forwards
        totals["nodes"] += sum(stats.tree_nodes_at)
        totals["drafted"] += stats.drafted
    assert totals["nodes"] == totals["drafted"] > 0
    assert TokenSource.BRANCH in sources and TokenSource.DRAFT in sources
    assert set(sources) <= {TokenSource.DRAFT, TokenSource.BRANCH, TokenSource.CORRECTION, TokenSource.BONUS,
                            TokenSource.TARGET}  # TARGET: a last step with no room to draft


@pytest.mark.parametrize("kind", ["tree", "ngram-tree"])
def test_trees_near_the_end_of_the_context(tiny_pair, kind):
    """A tree can hold more nodes than the context has room for: the engine keeps what fits."""
    from specdec import make_drafter

    target = load(tiny_pair["target"], dtype="float64")  # 128 positions
    drafter = make_drafter(kind, load(tiny_pair["same"], dtype="float64"), max_n=2, tree_budget=16)
    # 118 tokens where "9 5 6" recurs with four different continuations: the n-gram tree branches
    prompt = [token for k in range(29) for token in (5, 6, 1 + k % 4, 9)] + [5, 6]
    expected = SpeculativeDecoder(target).generate(prompt, max_new_tokens=50)
    result = SpeculativeDecoder(target, drafter, gamma=4).generate(prompt, max_new_tokens=50)
    assert result.token_ids == expected.token_ids and result.finish_reason == expected.finish_reason


@pytest.mark.slow
def test_tree_cost_policy_keeps_greedy_output(lean_models):  # noqa: F811
    target, drafts = lean_models
    drafters = {kind: ModelTreeDrafter(drafts[kind], budget=16, branching=3) for kind in ("same", "perturbed")}
    counts = check_equality(target, drafters, "tree-cost")
    assert counts["same"][0] > 0
