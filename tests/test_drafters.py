"""The n-gram and staged drafters, and the draft-length policies on synthetic acceptance."""

import random

import pytest
import torch
from table_lm import table_model

from specdec import SamplingParams, SpeculativeDecoder, make_drafter
from specdec.core.drafts import ContextRequest
from specdec.core.estimates import (
    AcceptanceByPosition,
    CostModel,
    VerifyCostTable,
    best_chain_length,
    predicted_speedup,
    speedup_ceiling,
)
from specdec.core.policy import CostModelPolicy, DraftShape, HeuristicPolicy, ThresholdPolicy, make_policy
from specdec.drafting import NGramDrafter, NGramIndex, StagedDrafter, StepOutcome

GREEDY = SamplingParams()


def propose(drafter, context, gamma):
    context = torch.as_tensor(context)
    return drafter.propose(ContextRequest.started(drafter, context), gamma).tokens.tolist()


@pytest.mark.parametrize("context, gamma, max_n, min_n, expected", [
    ([1, 2, 3, 4, 2, 3], 3, 2, 2, [4, 2, 3]),  # suffix [2 3] seen at 1..2: continue from 4
    ([1, 2, 3, 4, 2, 3], 2, 2, 2, [4, 2]),  # gamma caps the proposal
    ([1, 2, 3, 4, 2, 3], 8, 2, 2, [4, 2, 3]),  # the continuation ends at the context's end
    ([1, 2, 3, 4, 2, 3], 3, 3, 3, []),  # no earlier [4 2 3]: nothing
    ([5, 1, 7, 9, 1, 7, 8, 1, 7], 2, 2, 1, [8, 1]),  # the most recent earlier [1 7] (at 4) wins, not [9 1]
    ([5, 6, 9, 6, 1, 2, 6], 2, 3, 1, [1, 2]),  # falls back to n = 1: latest earlier 6 is at 3
    ([1, 2, 3], 4, 3, 1, []),  # nothing repeats
])
def test_ngram_worked_examples(context, gamma, max_n, min_n, expected):
    assert propose(NGramDrafter(max_n, min_n), context, gamma) == expected


def test_ngram_index_is_incremental():
    """Feeding the context in pieces gives the same index as all at once, and only new tokens are read."""
    rng = random.Random(0)
    tokens = [rng.randrange(5) for _ in range(200)]
    whole, pieces = NGramIndex(3, 1), NGramIndex(3, 1)
    whole.extend(tokens)
    position = 0
    while position < len(tokens):
        step = rng.randint(1, 6)
        pieces.extend(tokens[position : position + step])
        position += step
    assert pieces._latest == whole._latest
    drafter = NGramDrafter(3, 1)
    request = ContextRequest.started(drafter, torch.tensor(tokens[:100]))
    drafter.propose(request, 4)
    request.draft_state.tokens[50] = -1  # a rescan would notice and overwrite this
    request.context = torch.tensor(tokens[:110])
    drafter.observe(request, StepOutcome(torch.tensor(tokens[100:110]), num_drafted=9))
    drafter.propose(request, 4)
    assert request.draft_state.tokens[50] == -1 and len(request.draft_state.tokens) == 110


def test_ngram_sizes_are_checked():
    with pytest.raises(ValueError, match="1 <= min_n <= max_n"):
        NGramDrafter(max_n=2, min_n=3)


def test_unknown_drafter_and_policy_are_named():
    with pytest.raises(ValueError, match="unknown drafter 'forest'"):
        make_drafter("forest")
    with pytest.raises(ValueError, match="needs a draft model"):
        make_drafter("staged")
    with pytest.raises(ValueError, match="unknown policy 'magic'"):
        make_policy("magic", 4)


def test_staged_drafter_proposes_the_draft_models_greedy_chain():
    """The n-gram stage changes how many draft forwards it takes, not what the draft says."""
    draft = table_model(6, seed=101, sharpness=1.0)
    context = torch.tensor([1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2])
    plain = propose(make_drafter("model", draft), context, 6)
    staged = StagedDrafter(draft, max_n=2)
    request = ContextRequest.started(staged, context)
    assert staged.propose(request, 6).tokens.tolist() == plain
    assert request.draft_state.guessed > 0  # the n-gram stage was used (its counts are the request's own)


def test_staged_drafter_uses_fewer_draft_forwards_on_repetitive_text():
    """A draft that continues a repeating pattern: the stage's guesses are accepted in bulk."""
    target = table_model(6, seed=100)

    class CountingNetwork:
        def __init__(self, inner):
            self.inner, self.calls = inner, 0

        def new_cache(self, *args):
            return self.inner.new_cache(*args)

        def __call__(self, *args):
            self.calls += 1
            return self.inner(*args)

    forwards = {}
    for kind in ("model", "staged"):
        draft = table_model(6, seed=100)  # the target itself: a draft that always agrees
        draft.network = CountingNetwork(draft.network)
        SpeculativeDecoder(target, make_drafter(kind, draft, max_n=2), gamma=6).generate([1, 2, 3] * 4,
                                                                                         max_new_tokens=40)
        forwards[kind] = draft.network.calls
    assert forwards["staged"] < forwards["model"]


def synthetic_steps(policy, alpha, steps, rng, draft_seconds=0.1, verify_base=1.0, verify_slope=0.05):
    """Feed a policy steps of i.i.d. acceptance with probability alpha and fixed costs."""
    drafted_lengths = []
    for _ in range(steps):
        asked = policy.next_shape()
        gamma = asked.depth
        accepted = 0
        while accepted < gamma and rng.random() < alpha:
            accepted += 1
        # (the engine records each step's T in the policy's cost model; the policy its draft cost)
        if hasattr(policy, "costs"):
            policy.costs.verify.add(1, gamma + 1, verify_base + verify_slope * (gamma + 1))
        policy.update(asked, gamma, accepted, draft_seconds * gamma)
        drafted_lengths.append(gamma)
    return drafted_lengths


def test_cost_model_drafts_longer_when_acceptance_is_high():
    high = synthetic_steps(CostModelPolicy(), 0.9, 300, random.Random(0))
    low = synthetic_steps(CostModelPolicy(), 0.3, 300, random.Random(0))
    assert sum(high[-100:]) / 100 > sum(low[-100:]) / 100 + 2
    # At alpha 0.3 with c = 0.1 the formula's best is a short draft; at 0.9 a long one.
    assert sum(low[-100:]) / 100 <= 2.5 and sum(high[-100:]) / 100 >= 5


def test_cost_model_matches_the_leviathan_formula_on_known_costs():
    policy = CostModelPolicy(max_gamma=10, acceptance=AcceptanceByPosition(max_gamma=10, prior_weight=1e-9))
    synthetic_steps(policy, 0.8, 2000, random.Random(1))
    alpha, c = 0.8, 0.1

    # T(k) = 1 + 0.05 k, as synthetic_steps charges
    best = max(range(1, 11), key=lambda g: predicted_speedup(alpha, g, c, 1 + 0.05 * (g + 1)))
    assert abs(policy.next_shape().depth - best) <= 1


def test_cost_model_decodes_plainly_with_probes_where_drafting_does_not_pay():
    """alpha 0.2, a draft token costing 0.3 of a verify and each verified token 0.4 more (T(k)
    nearly linear in k): gamma 0 is best; a probe every 8 steps (its cost allows 17: capped at the
    longest period, 8 here) keeps measuring."""
    policy = CostModelPolicy(costs=CostModel(max_probe_period=8))
    lengths = synthetic_steps(policy, 0.2, 300, random.Random(2), draft_seconds=0.3, verify_slope=0.4)
    assert lengths[-96:].count(0) == 84 and lengths[-96:].count(1) == 12
    paying = synthetic_steps(CostModelPolicy(costs=CostModel(max_probe_period=8)), 0.2, 300, random.Random(2),
                             draft_seconds=0.01)
    assert 0 not in paying[-100:]  # cheap drafts and verify (slope 0.05) at the same alpha: always drafting


def test_one_slow_block_long_ago_does_not_stop_the_cost_policy_drafting():
    """A block size drafted once, in a slow moment, and never again keeps its mean (decay scales
    sum and count alike); the line through the sizes weighs it by its faded count, so the sizes
    measured every step decide. Measured on an int4 target: one slow 4-token block, and the policy
    stopped drafting for the rest of the run. Unweighted, the line here gives T(1) 0.9 and T(2)
    2.2, and the policy chooses plain decoding."""
    table = VerifyCostTable()
    table.add(1, 4, 5.0)  # one 4-token block, 2.3x its real cost
    for _ in range(100):  # then blocks of 1 and 2 tokens, T(k) = 1 + 0.3 k
        table.add(1, 2, 1.6)
        table.add(1, 1, 1.3)
    verify = table.curve(1)
    assert verify is not None and abs(verify(1) - 1.3) < 0.05 and abs(verify(2) - 1.6) < 0.05
    assert abs(verify(3) - 1.9) < 0.05  # the line through the sizes measured lately, not the old slow one
    # alpha 0.6: drafting pays (one token: 1.6 tokens for 1.61 s, two: 1.96 for 1.92, against 1 for 1.3)
    assert best_chain_length(AcceptanceByPosition(), 0.01, verify, 4) == 2


def test_threshold_policy_shortens_drafts_when_acceptance_falls():
    policy = ThresholdPolicy(max_gamma=8)

    def draft_length():  # a draft whose per-token confidence is 0.9: chain probability 0.9^n
        for n in range(1, 9):
            if policy.stop_early(n, 0.9**n):
                return n
        return 8

    synthetic_steps(policy, 0.95, 100, random.Random(2))
    long_drafts = draft_length()
    synthetic_steps(policy, 0.2, 100, random.Random(3))
    short_drafts = draft_length()
    assert short_drafts < long_drafts


def test_heuristic_policy_grows_and_shrinks():
    policy = HeuristicPolicy(4)
    policy.update(DraftShape(4), 4, 4, 0.0)
    assert policy.next_shape() == DraftShape(6)
    policy.update(DraftShape(6), 6, 2, 0.0)
    assert policy.next_shape() == DraftShape(5)
    for _ in range(10):
        policy.update(DraftShape(5), 5, 0, 0.0)
    assert policy.next_shape() == DraftShape(1)


def settle_tree_shape(alpha_at_width, verify_seconds, draft_seconds_per_depth: float, steps: int = 300):
    """Synthetic steps for TreeCostPolicy: a level of w nodes is accepted with probability
    alpha_at_width(w) (seeded); the shapes (depth, width) chosen over the last 100 steps."""
    import random

    from specdec.core.policy import TreeCostPolicy

    policy, rng, chosen = TreeCostPolicy(gamma=4), random.Random(0), []
    for _ in range(steps):
        asked = policy.next_shape()
        assert policy.next_shape() == asked  # a pure query
        depth, width = asked.depth, asked.node_budget // asked.depth
        accepted = 0
        while accepted < depth and rng.random() < alpha_at_width(width):
            accepted += 1
        policy.costs.verify.add(1, depth * width + 1, verify_seconds(depth * width + 1))  # (the engine's part)
        policy.update(asked, depth * width, accepted, depth * draft_seconds_per_depth, [width] * depth)
        chosen.append((depth, width))
    return chosen[-100:]


def test_tree_cost_policy_widens_trees_where_width_pays():
    """Each sibling is a fresh chance (alpha 0.4 for one node, 0.87 for four) and a node costs
    almost nothing to verify: the policy settles on the widest, deep trees."""
    late = settle_tree_shape(lambda width: 1 - 0.6**width, lambda block: 1.0 + 0.002 * block, 0.01)
    assert sum(width == 4 for _, width in late) >= 80
    assert sum(depth >= 6 for depth, _ in late) >= 80


def test_tree_cost_policy_narrows_trees_where_width_does_not_pay():
    """Siblings add nothing (alpha 0.6 at every width) and each verified node costs 10% of a
    block: width 1 wins, and depth stays short (deep levels are rarely reached)."""
    late = settle_tree_shape(lambda width: 0.6, lambda block: 1.0 + 0.1 * block, 0.02)
    assert sum(width == 1 for _, width in late) >= 80  # the rest: wider shapes re-measured now and then
    assert sum(depth <= 3 for depth, width in late if width == 1) >= 80


def test_tree_cost_policy_stays_shallow_when_drafts_are_rarely_accepted():
    """alpha 0.1 per node and a draft depth costing 30% of a verify: one level is the most that pays."""
    late = settle_tree_shape(lambda width: 0.1 * width, lambda block: 1.0 + 0.01 * block, 0.3)
    assert sum(depth == 1 for depth, _ in late) >= 90


def test_the_cost_policy_builds_its_estimators_from_its_own_settings():
    """Mutation note: estimators built with their own defaults (decay 0.98, 12 positions) fail it."""
    policy = CostModelPolicy(max_gamma=16, costs=CostModel(decay=0.9, max_probe_period=5))
    for estimators in (policy, policy.for_request()):
        assert estimators.acceptance.max_gamma == 16 and estimators.acceptance.decay == 0.9
        assert estimators.costs.verify.decay == 0.9 and estimators.costs.draft().decay == 0.9
        assert estimators.costs.max_probe_period == 5


def test_speedup_ceiling_weighs_the_blocks_the_drafts_reach_and_what_drafting_costs():
    flat_to_three = {1: 0.010, 2: 0.010, 3: 0.010, 5: 0.030}
    assert speedup_ceiling(flat_to_three) == (2, pytest.approx(3.0))  # 3 tokens for one T(1)
    assert speedup_ceiling({1: 0.01, 2: 0.02, 3: 0.03}) == (0, 1.0)  # blocks cost k T(1): nothing to gain
    # reach is unconditional (steps past depth d): 1 + 0.5 + 0.25 tokens for one T(1).
    assert speedup_ceiling(flat_to_three, reach=[0.5, 0.25]) == (2, pytest.approx(1.75))
    assert speedup_ceiling(flat_to_three, reach=[0.5]) == (1, pytest.approx(1.5))  # no reach past depth 1
    # Drafting at 0.25 T(1) a token: 3 / (1 + 2 * 0.25) for two drafts.
    assert speedup_ceiling(flat_to_three, draft_fraction=0.25) == (2, pytest.approx(2.0))
