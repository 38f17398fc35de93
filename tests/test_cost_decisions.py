"""Properties of every decider on an engine's one cost model (estimates.CostModel): the ``cost``
and ``tree-cost`` policies, the server's controller and the ``auto`` drafter each choose the draft
with the highest expected tokens per second that their fresh estimates give; probe periods stay
within their bounds; no forward candidate starves; the engine records T with the step's real batch
and block. (These replace replays whose recorded decisions were re-recorded each time a decision
legitimately changed: records, not checks.) The calculator's choices stay checked against values
recorded before the one cost model (main at b2e2b42), which no change since has touched."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import SpeculativeDecoder, load
from specdec.core.drafts import BaseDrafter, ContextRequest, Draft, StepOutcome
from specdec.core.estimates import MIN_PROBE_PERIOD, AcceptanceByPosition, CostModel, reach_sum, tokens_per_second
from specdec.core.policy import make_policy
from specdec.drafting.auto import AutoDrafter
from specdec.drafting.ngram import NGramDrafter
from specdec.explain.calculator import best_row, speedup_table
from specdec.serving.speculation import SpeculationController

GAMMA = 6

# T(1, k) grows by ``slope`` of T(1) a token; drafting a token costs ``draft`` seconds; alphas by depth.
verify_one = st.floats(0.005, 0.05)
slopes = st.floats(0.0, 1.0)
draft_costs = st.floats(0.0, 0.05)
alpha_lists = st.lists(st.floats(0.0, 1.0), min_size=GAMMA, max_size=GAMMA)


def chain_costs(t1: float, slope: float, batch: int = 1, blocks: int = GAMMA + 1) -> CostModel:
    """A cost model with T(batch, k) measured once for every block k up to ``blocks``."""
    costs = CostModel()
    for block in range(1, blocks + 1):
        costs.verify.add(batch, block, t1 * (1 + slope * (block - 1)))
    return costs


def taught(acceptance: AcceptanceByPosition, alphas: list[float], steps: int = 40) -> AcceptanceByPosition:
    """``acceptance`` after ``steps`` steps accepted exactly at ``alphas`` on average (fractions)."""
    for depth, alpha in enumerate(alphas):
        while len(acceptance.accepted_given_reached) <= depth:
            acceptance.update(depth + 1, depth + 1)  # (grows the list; its weight decays below)
        acceptance.accepted_given_reached[depth].total = alpha * steps
        acceptance.accepted_given_reached[depth].count = float(steps)
    return acceptance


def best_rate(acceptance: AcceptanceByPosition, draft: float, verify, most: int, width: int = 1) -> float:
    """The highest tokens per second over chain lengths 0..most, by brute force."""
    alphas = acceptance.alphas(width)
    return max(tokens_per_second(reach_sum(alphas[:g]), g, draft, verify(g + 1)) or 0.0 for g in range(most + 1))


@settings(max_examples=60, deadline=None)
@given(verify_one, slopes, draft_costs, alpha_lists, st.integers(1, 4))
def test_the_cost_policy_drafts_the_length_of_the_highest_rate(t1, slope, draft, alphas, batch):
    """Mutation, checked: best_chain_length reading T(1, k) whatever the batch fails the batch > 1
    cases (one request's blocks cost what a flat line says; the batch's, ``slope``)."""
    costs = chain_costs(t1, slope, batch, blocks=13)
    if batch > 1:  # one request's T(k), unlike the batch's
        for block in range(1, 14):
            costs.verify.add(1, block, t1 * (1 + 0.01 * (block - 1)))
    costs.observe_draft(draft, 1)
    policy = make_policy("cost", 4, costs=costs)
    taught(policy.acceptance, alphas)
    depth = policy.next_shape(batch).depth
    curve = costs.verify.curve(batch)
    rate = tokens_per_second(policy.acceptance.expected_tokens(depth), depth, draft, curve(depth + 1))
    best = best_rate(policy.acceptance, draft, curve, 12)
    # (no draft pays: a plain step, or a one-token probe when one is due)
    assert rate == pytest.approx(best) or (depth == 1 and best == pytest.approx(1 / curve(1)))


@settings(max_examples=40, deadline=None)
@given(verify_one, draft_costs, st.floats(0.05, 0.95), st.floats(0.0, 0.3))
def test_the_tree_cost_policy_drafts_the_shape_of_the_highest_rate(t1, draft, alpha, width_penalty):
    costs = CostModel()
    for block in range(1, 66):  # flat to 8 tokens, then 12% of T(1) a token
        costs.verify.add(1, block, t1 * (1 + 0.01 * (block - 1) + 0.12 * max(0, block - 8)))
    policy = make_policy("tree-cost", 4, costs=costs)
    for width in range(1, 5):
        costs.observe_draft(draft * (1 + width_penalty * (width - 1)), 1, width)
    taught(policy.acceptance, [alpha] * 8)
    shape = policy.next_shape()
    curve, rates = costs.verify.curve(1), {}
    for depth, width in policy.shapes():
        rates[depth, width] = tokens_per_second(reach_sum(policy.acceptance.alphas(width)[:depth]), depth,
                                                costs.draft().seconds(width), curve(depth * width + 1))
    chosen = (shape.depth, (shape.node_budget or shape.depth) // shape.depth)
    assert rates[chosen] == pytest.approx(max(rates.values()))


class Client:
    """A request as the controller sees it (it keeps each one's acceptance by a weak reference)."""


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=3), st.floats(0.0, 0.3), draft_costs)
def test_the_servers_controller_gives_the_batch_its_best_lengths(alphas, slope, draft):
    """Every vector of lengths (0..3 each) tried: none beats the controller's. Mutation, checked:
    taking the tokens by position, not by reach, fails where requests' alphas differ."""
    batch, gamma = len(alphas), 3
    costs = CostModel()
    for block in range(1, gamma + 2):
        costs.verify.add(batch, block, 0.02 * (1 + slope * batch * (block - 1)))
    controller = SpeculationController("auto", gamma, costs)
    costs.observe_draft(draft, 1)
    requests = [Client() for _ in alphas]
    for request, alpha in zip(requests, alphas, strict=True):
        taught(controller.acceptance_of(request), [alpha] * gamma)
    reaches = [controller.acceptance_of(request).reaches(gamma) for request in requests]
    curve = costs.verify.curve(batch)

    def rate(lengths) -> float:
        expected = batch + sum(sum(reach[:length]) for reach, length in zip(reaches, lengths, strict=True))
        count = sum(lengths)
        return tokens_per_second(expected / batch, count / batch, draft, curve(1 + count / batch), batch) or 0.0

    lengths = controller.draft_lengths(requests)
    best = max(rate(vector) for vector in itertools.product(range(gamma + 1), repeat=batch))
    assert rate(lengths) == pytest.approx(best) or (sum(lengths) == 1 and best == pytest.approx(rate([0] * batch)))


@settings(max_examples=60, deadline=None)
@given(verify_one, slopes, draft_costs, alpha_lists, alpha_lists, st.integers(0, GAMMA), st.integers(1, 4))
def test_auto_chooses_the_highest_rate_among_fresh_estimates(t1, slope, draft, copy_alphas, head_alphas,
                                                             copy_length, batch):
    """Its choice's rate is the best over no draft, the copy's lengths up to its draft's and the
    head's up to gamma, at the step's batch. Mutation, checked: the head's draft cost left out of
    its rate fails it."""
    auto = AutoDrafter({"copy": NGramDrafter(3), "head": NGramDrafter(3)}, ("copy",),
                       costs=chain_costs(t1, slope, batch))
    auto.costs.draft("head").add(draft, 1)
    state = auto.start(torch.tensor([1, 2, 3]))
    state.shadows = [list(range(copy_length)), None]
    taught(state.estimates(0), copy_alphas)
    taught(state.estimates(1), head_alphas)
    choice = auto.choose(state, GAMMA, batch)
    curve = auto.costs.verify.curve(batch)
    best = max(best_rate(state.estimates(0), 0.0, curve, copy_length),
               best_rate(state.estimates(1), draft, curve, GAMMA))
    assert choice.rate == pytest.approx(best) and not choice.probe
    index = choice.candidate
    expected = 1.0 if index is None else state.estimates(index).expected_tokens(choice.length)
    assert tokens_per_second(expected, choice.length, draft if index == 1 else 0.0, curve(choice.length + 1)) == \
        pytest.approx(best)


@settings(max_examples=100, deadline=None)
@given(st.floats(0.001, 1.0), st.floats(0.0, 1.0), st.one_of(st.none(), draft_costs), st.integers(1, 128),
       st.integers(1, 2), st.integers(1, 8))
def test_probe_periods_stay_within_their_bounds(t1, growth, draft, longest, steps, batch):
    costs = CostModel(max_probe_period=longest)
    costs.verify.add(batch, 1, t1)
    costs.verify.add(batch, 2, t1 * (1 + growth))
    period = costs.probe_period(draft, batch, steps)
    assert min(MIN_PROBE_PERIOD, longest) <= period <= longest
    assert draft is not None or period == longest


class Costly(BaseDrafter):
    """A forward candidate that is never worth its cost: its drafts are always wrong."""

    def start(self, prompt_ids: torch.Tensor) -> None:
        return None

    def propose(self, request, gamma: int) -> Draft:
        return Draft(torch.full((gamma,), 999, dtype=torch.long), None, None)

    def observe(self, request, outcome: StepOutcome) -> None:
        pass


@pytest.mark.parametrize("seconds_per_token", [1e-5, 0.002, 1.0])
def test_no_candidate_starves(seconds_per_token):
    """A forward candidate that is never best drafts again within every window of the longest
    probe period (two steps in a row), however costly."""
    auto = AutoDrafter({"copy": NGramDrafter(3), "costly": Costly()}, ("copy",), costs=chain_costs(0.01, 0.02))
    auto.costs.draft("costly").add(seconds_per_token, 1)
    request = ContextRequest.started(auto, torch.tensor([1, 2, 3, 1, 2]))
    drafted = []
    for step in range(300):
        draft = auto.propose(request, 4)
        if draft.drafter == "costly":
            drafted.append(step)
        auto.observe(request, StepOutcome(torch.tensor([7]), draft.num_nodes, drafter=draft.drafter))
    gaps = [later - earlier for earlier, later in itertools.pairwise([-1, *drafted, 300])]
    assert drafted and max(gaps) <= auto.costs.max_probe_period + 1, drafted


def test_the_engine_records_t_with_the_real_batch_and_block(tiny_pair):
    """Three requests decoded together (the same prompt: they finish on the same step): every T
    cell the engine records is batch 3, none of the batch-1 cells each request used to record.
    Mutation, checked: recording per request at batch 1 fails."""
    target = load(tiny_pair["target"], dtype="float64")
    decoder = SpeculativeDecoder(target, "ngram", gamma=3)
    decoder.generate([[1, 2, 3, 1, 2, 3, 1, 2]] * 3, max_new_tokens=12)
    cells = decoder.engine.costs.verify.cells
    assert cells and {batch for batch, _ in cells} == {3}
    assert any(block > 1 for _, block in cells)  # the drafted blocks' mean, not one token


def test_one_cost_model_per_engine(tiny_pair):
    """auto's model is its engine's; a policy beside auto is refused; a server's controller reads
    the engine's model."""
    from specdec.serving.server import build_app

    target = load(tiny_pair["target"], dtype="float64")
    decoder = SpeculativeDecoder(target, "auto")
    assert decoder.engine.costs is decoder.drafter.costs
    with pytest.raises(ValueError, match="does not apply to --drafter auto"):
        SpeculativeDecoder(target, "auto", policy="cost")
    with pytest.raises(ValueError, match="different cost models"):
        SpeculativeDecoder(target, AutoDrafter({"ngram": NGramDrafter(3)}, ("ngram",)), costs=CostModel())
    auto = AutoDrafter({"ngram": NGramDrafter(3)}, ("ngram",))
    app = build_app(target, auto, "tiny", costs=chain_costs(0.01, 0.1).verify)
    scheduler = app.state.scheduler
    assert scheduler.controller.costs is scheduler.engine.costs is scheduler.engine.drafter.costs
    assert scheduler.engine.costs.verify.curve(1) is not None  # the startup table, in the engine's model


RECORDED = json.loads((Path(__file__).parent / "cost_decisions.json").read_text())["calculator (recorded at b2e2b42)"]


def test_the_calculator_decides_as_recorded():
    """Mutation: gamma * c -> (gamma + 1) * c in the rate moves the best gammas."""
    best = [best_row(speedup_table(alpha, c, 10, costs)).gamma
            for alpha in (0.3, 0.6, 0.8, 0.95) for c in (0.0, 0.05, 0.4)
            for costs in (None, [1 + 0.05 * (g + 1) for g in range(1, 11)], [1 + 0.3 * g for g in range(1, 11)])]
    rows = speedup_table(0.8, 0.05, 4, [1.1, 1.15, 1.2, 1.25])
    assert best == RECORDED["calculator: best gammas"]
    assert [round(row.speedup, 6) for row in rows] == RECORDED["calculator: speedups"]
    assert [round(row.expected_tokens, 6) for row in rows] == RECORDED["calculator: tokens"]
