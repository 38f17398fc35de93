"""How much to draft next: fixed, heuristic, threshold and cost-model policies.

One interface: ``next_shape(batch)`` before a step (a pure query: the draft's depth and, for
trees, its node budget, for a request of a step of ``batch``), ``stop_early`` (a rule
``(drafted, chain_prob) -> bool`` that model drafters consult after each token, or None for
policies that never cut a draft, so drafters skip computing the chain probability), and
``update(asked, ...)`` after verification, with the shape that was asked. The cost policies are
clients of their engine's one cost model (specdec.core.estimates.CostModel), which the engine gives
them (make_policy's ``costs``) and where it records every step's verify seconds itself.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from specdec.core.estimates import AcceptanceByPosition, CostModel, ProbeRule
from specdec.names import POLICIES, TREE_COST_MAX_BUDGET, TREE_POLICIES


@dataclass(frozen=True)
class DraftShape:
    """What a policy asks of the next draft: ``depth`` tokens along any path (a chain's length),
    and for tree drafters at most ``node_budget`` nodes (None: the drafter's own budget)."""

    depth: int
    node_budget: int | None = None


class DraftLengthPolicy(Protocol):
    name: str

    @property
    def stop_early(self) -> Callable[[int, float], bool] | None:
        """A rule that cuts a draft short, or None for policies that never do."""

    def next_shape(self, batch: int = 1) -> DraftShape:
        """The next draft's shape for a request of a step of ``batch`` requests, from what was
        learned so far; changes nothing."""

    def update(self, asked: DraftShape, num_drafted: int, num_accepted: int, draft_seconds: float,
               widths: list[int] | None = None) -> None:
        """After a step that asked for ``asked``: num_drafted nodes (a tree's ``widths`` per
        depth), num_accepted of them accepted, the seconds drafting took (the step's verify
        seconds the engine records in the cost model)."""

    def for_request(self) -> DraftLengthPolicy:
        """This policy's copy for a new request. What depends on the text (acceptance, an adapted
        gamma) starts fresh; measured seconds, which depend on the models and the machine, are
        shared by the requests of one engine, so later requests do not pay to measure them again."""


class FixedPolicy:
    name = "fixed"
    stop_early: Callable[[int, float], bool] | None = None  # never cuts a draft short

    def __init__(self, gamma: int) -> None:
        self.gamma = gamma

    def next_shape(self, batch: int = 1) -> DraftShape:
        return DraftShape(self.gamma)  # trees keep their drafter's node budget

    def for_request(self) -> DraftLengthPolicy:
        return copy.deepcopy(self)  # nothing measured to share

    def update(self, asked: DraftShape, num_drafted: int, num_accepted: int, draft_seconds: float,
               widths: list[int] | None = None) -> None:
        """A fixed gamma learns nothing."""


class DrafterChoosesPolicy(FixedPolicy):
    """For the auto drafter, which chooses each step's draft and its length itself (from measured
    acceptance and costs, specdec.drafting.auto): the policy only caps the length at gamma."""

    name = "auto"


class HeuristicPolicy(FixedPolicy):
    """+2 after a step whose drafts were all accepted, -1 otherwise (transformers' "heuristic")."""

    name = "heuristic"

    def __init__(self, gamma: int, max_gamma: int = 16) -> None:
        super().__init__(gamma)
        self.max_gamma = max_gamma

    def update(self, asked: DraftShape, num_drafted: int, num_accepted: int, draft_seconds: float,
               widths: list[int] | None = None) -> None:
        if num_drafted == 0:
            return
        self.gamma = min(self.max_gamma, self.gamma + 2) if num_accepted == num_drafted else max(1, self.gamma - 1)


class ThresholdPolicy(FixedPolicy):
    """Draft up to max_gamma tokens, stopping when the draft's probability for the chain so far
    falls below a threshold. The threshold adapts: it falls after a fully accepted step (draft
    longer) and rises after a rejection (draft shorter), so drafts shorten when acceptance falls."""

    name = "threshold"

    def __init__(self, max_gamma: int = 8, threshold: float = 0.4, step: float = 0.05,
                 bounds: tuple[float, float] = (0.05, 0.95)) -> None:
        super().__init__(max_gamma)
        self.threshold, self.step, self.bounds = threshold, step, bounds
        self.stop_early = self.below_threshold

    def below_threshold(self, drafted: int, chain_probability: float) -> bool:
        return chain_probability < self.threshold

    def update(self, asked: DraftShape, num_drafted: int, num_accepted: int, draft_seconds: float,
               widths: list[int] | None = None) -> None:
        if num_drafted == 0:
            return
        low, high = self.bounds
        if num_accepted == num_drafted:
            self.threshold = max(low, self.threshold - self.step)
        else:
            self.threshold = min(high, self.threshold + self.step)


@dataclass
class CostModelPolicy:
    """Draft the gamma with the highest expected tokens per second (Leviathan et al. 2023,
    with measured costs): E[tokens](g) from the per-position acceptance estimates, and
    time(g) = g * draft_cost + T(batch, g + 1), both measured in ``costs`` (estimates.CostModel)."""

    gamma: int = 4  # used until there is something to estimate from
    max_gamma: int = 12
    name: str = "cost"
    stop_early = None  # decides the length up front; never cuts a draft short
    costs: CostModel = field(default_factory=CostModel)  # seconds, shared by an engine's requests
    # None: built in __post_init__ from costs (the ignore: never None after it).
    acceptance: AcceptanceByPosition = None  # type: ignore[assignment]
    # Where no draft length beats plain decoding (measured: the llama.cpp backend on 2 cores, whose
    # verify blocks cost nearly their length in forwards): plain steps, and now and then a one-token probe.
    probe: ProbeRule = field(default_factory=ProbeRule)

    def __post_init__(self) -> None:
        if self.acceptance is None:
            self.acceptance = self.costs.acceptance(self.max_gamma)

    def for_request(self) -> CostModelPolicy:
        """Fresh acceptance estimates; the draft and verify seconds measured so far, shared."""
        return CostModelPolicy(self.gamma, self.max_gamma, costs=self.costs)

    def next_shape(self, batch: int = 1) -> DraftShape:
        best = self.costs.best_chain_length(self.acceptance, self.max_gamma, batch=batch)
        if best is None:
            return DraftShape(self.gamma)
        if best > 0:
            return DraftShape(best)
        return DraftShape(1 if self.probe.due(self.costs.probe_period(self.costs.draft().seconds(), batch)) else 0)

    def update(self, asked: DraftShape, num_drafted: int, num_accepted: int, draft_seconds: float,
               widths: list[int] | None = None) -> None:
        self.acceptance.update(num_drafted, num_accepted)
        self.costs.observe_draft(draft_seconds, num_drafted)
        self.probe.observe(num_drafted > 0)


class TreeCostPolicy(FixedPolicy):
    """For token trees: the depth and the nodes per depth (width, 1 to ``max_width``) with the
    highest expected tokens per second, from measured costs (estimates.CostModel.best_tree_shape):
    E[tokens](d, w) from the acceptance per depth and width; time(d, w) = d * draft(w) +
    T(1, d * w + 1), with draft(w) the measured draft seconds per depth at that width (the nearest
    width measured, until it is). So trees narrow where width does not pay for its verify and draft
    cost, and grow shallow where depth does not. The drafter gets depth d (gamma) and a node
    budget of d * w. Until both costs have been measured once, the starting shape: depth gamma,
    width 1."""

    name = "tree-cost"

    def __init__(self, gamma: int, max_depth: int = 8, max_width: int = 4, max_budget: int = TREE_COST_MAX_BUDGET,
                 costs: CostModel | None = None) -> None:
        super().__init__(gamma)
        self.max_depth, self.max_width, self.max_budget = max(max_depth, gamma), max_width, max_budget
        self.costs = costs if costs is not None else CostModel()  # seconds, shared by an engine's requests
        self.acceptance = self.costs.acceptance(self.max_depth)

    def for_request(self) -> TreeCostPolicy:
        """Fresh acceptance estimates; the draft and verify seconds measured so far, shared."""
        return TreeCostPolicy(self.gamma, self.max_depth, self.max_width, self.max_budget, self.costs)

    def shapes(self) -> list[tuple[int, int]]:
        return [
            (depth, width)
            for depth in range(1, self.max_depth + 1)
            for width in range(1, self.max_width + 1)
            if depth * width <= self.max_budget
        ]

    def next_shape(self, batch: int = 1) -> DraftShape:
        best = self.costs.best_tree_shape(self.acceptance, self.shapes(), batch=batch)
        if best is None:
            return DraftShape(self.gamma, min(self.gamma, self.max_budget))  # the starting shape: width 1
        depth, width = best
        return DraftShape(depth, depth * width)

    def update(self, asked: DraftShape, num_drafted: int, num_accepted: int, draft_seconds: float,
               widths: list[int] | None = None) -> None:
        if num_drafted == 0:
            return
        # What is learned is what asking for a width gives: a drafter may deliver fewer nodes (a
        # chain drafter always one per depth, an n-gram tree as many as the text offers).
        width = max(1, (asked.node_budget or asked.depth) // max(1, asked.depth))
        levels = len(widths) if widths else num_drafted
        self.acceptance.update(num_drafted, num_accepted, [width] * levels)
        self.costs.observe_draft(draft_seconds, levels, width)


def make_policy(name: str, gamma: int, node_budget: int | None = None,
                costs: CostModel | None = None) -> DraftLengthPolicy:
    """A policy by name; gamma is its starting (or, for threshold, maximum) draft length;
    ``node_budget`` (--tree-budget, given): the most tree nodes tree-cost may choose (else its own
    cap); ``costs``: the engine's one cost model, which the cost policies read (None: their own)."""
    costs = costs if costs is not None else CostModel()
    if name == "fixed":
        return FixedPolicy(gamma)
    if name == "heuristic":
        return HeuristicPolicy(gamma)
    if name == "threshold":
        return ThresholdPolicy(max_gamma=gamma)
    if name == "cost":
        return CostModelPolicy(gamma=gamma, costs=costs)
    if name == "tree-cost":
        return TreeCostPolicy(gamma, max_budget=TREE_COST_MAX_BUDGET if node_budget is None else node_budget,
                              costs=costs)
    if name == "auto":
        return DrafterChoosesPolicy(gamma)
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES + TREE_POLICIES)}")
