"""How many tokens to draft next: fixed, heuristic, threshold and cost-model policies.

One interface: ``next_gamma()`` before a step, ``stop_early`` (a rule ``(drafted, chain_prob) ->
bool`` that model drafters consult after each token, or None for policies that never cut a draft,
so drafters skip computing the chain probability), and ``update(...)`` after verification.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


class DraftLengthPolicy(Protocol):
    name: str
    stop_early: Callable[[int, float], bool] | None
    node_budget: int | None  # for tree drafters: most nodes this step (None: the drafter's own)

    def next_gamma(self) -> int: ...

    def update(self, num_drafted: int, num_accepted: int, draft_seconds: float, verify_seconds: float) -> None: ...


class FixedPolicy:
    name = "fixed"
    stop_early = None  # never cuts a draft short
    node_budget = None  # trees keep their drafter's budget

    def __init__(self, gamma: int) -> None:
        self.gamma = gamma

    def next_gamma(self) -> int:
        return self.gamma

    def update(self, num_drafted: int, num_accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        """A fixed gamma learns nothing."""


class HeuristicPolicy(FixedPolicy):
    """+2 after a step whose drafts were all accepted, -1 otherwise (transformers' "heuristic")."""

    name = "heuristic"

    def __init__(self, gamma: int, max_gamma: int = 16) -> None:
        super().__init__(gamma)
        self.max_gamma = max_gamma

    def update(self, num_drafted: int, num_accepted: int, draft_seconds: float, verify_seconds: float) -> None:
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

    def stop_early(self, drafted: int, chain_probability: float) -> bool:
        return chain_probability < self.threshold

    def update(self, num_drafted: int, num_accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        if num_drafted == 0:
            return
        low, high = self.bounds
        if num_accepted == num_drafted:
            self.threshold = max(low, self.threshold - self.step)
        else:
            self.threshold = min(high, self.threshold + self.step)


@dataclass
class RunningMean:
    total: float = 0.0
    count: float = 0.0

    def add(self, value: float, weight: float = 1.0) -> None:
        self.total += value * weight
        self.count += weight

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


@dataclass
class AcceptanceByPosition:
    """Online estimates of alpha_j = P(accept draft position j | positions before it accepted),
    decayed so that they follow the text's drifting difficulty. Each position's prior is the
    estimate of the position before it (the first's is prior_alpha), so positions never drafted
    yet inherit what was seen closer in instead of a fixed guess, and longer drafts get explored."""

    max_gamma: int = 12
    prior_alpha: float = 0.6
    prior_weight: float = 2.0
    decay: float = 0.98
    accepted_given_reached: list[RunningMean] = field(default_factory=list)

    def alphas(self) -> list[float]:
        estimates, prior = [], self.prior_alpha
        for position in range(self.max_gamma):
            stat = self.accepted_given_reached[position] if position < len(self.accepted_given_reached) else None
            total, count = (stat.total, stat.count) if stat else (0.0, 0.0)
            prior = (total + prior * self.prior_weight) / (count + self.prior_weight)
            estimates.append(prior)
        return estimates

    def expected_tokens(self, gamma: int) -> float:
        """E[tokens emitted by one step drafting gamma] = 1 + sum_{i<=gamma} prod_{j<=i} alpha_j."""
        expected, reach = 1.0, 1.0
        for alpha in self.alphas()[:gamma]:
            reach *= alpha
            expected += reach
        return expected

    def update(self, num_drafted: int, num_accepted: int) -> None:
        for stat in self.accepted_given_reached:
            stat.total *= self.decay
            stat.count *= self.decay
        while len(self.accepted_given_reached) < num_drafted:
            self.accepted_given_reached.append(RunningMean())
        # Positions 0..num_accepted were reached; all but the first rejected one were accepted.
        for position in range(min(num_drafted, num_accepted + 1)):
            self.accepted_given_reached[position].add(1.0 if position < num_accepted else 0.0)


@dataclass
class CostModelPolicy:
    """Draft the gamma with the highest expected tokens per second (Leviathan et al. 2023,
    with measured costs): E[tokens](g) from the per-position acceptance estimates, and
    time(g) = g * draft_cost + T(g + 1), with T(k) the measured verify cost of a k-token block
    (a straight-line fit over the block sizes seen so far)."""

    gamma: int = 4  # used until there is something to estimate from
    max_gamma: int = 12
    decay: float = 0.98  # forget old steps slowly: text difficulty drifts
    name: str = "cost"
    stop_early = None  # decides the length up front; never cuts a draft short
    node_budget = None
    acceptance: AcceptanceByPosition | None = None
    draft_cost: RunningMean = field(default_factory=RunningMean)
    verify_cost: dict[int, RunningMean] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.acceptance is None:
            self.acceptance = AcceptanceByPosition(max_gamma=self.max_gamma, decay=self.decay)

    def verify_seconds(self, block: int) -> float | None:
        points = [(k, m.mean) for k, m in self.verify_cost.items() if m.mean is not None]
        if not points:
            return None
        if len(points) == 1:  # one block size seen: assume a mild slope (int8 CPU / GPU regime)
            k0, t0 = points[0]
            return t0 * (1 + 0.05 * (block - k0))
        n = len(points)
        mean_k = sum(k for k, _ in points) / n
        mean_t = sum(t for _, t in points) / n
        var = sum((k - mean_k) ** 2 for k, _ in points)
        slope = max(0.0, sum((k - mean_k) * (t - mean_t) for k, t in points) / var)
        return max(1e-9, mean_t + slope * (block - mean_k))

    def expected_rate(self, gamma: int) -> float | None:
        """Expected tokens per second when drafting gamma tokens."""
        verify = self.verify_seconds(gamma + 1)
        draft = self.draft_cost.mean
        if verify is None or (gamma > 0 and draft is None):
            return None
        return self.acceptance.expected_tokens(gamma) / (gamma * (draft or 0.0) + verify)

    def next_gamma(self) -> int:
        rates = {g: self.expected_rate(g) for g in range(0, self.max_gamma + 1)}
        if any(rate is None for g, rate in rates.items() if g > 0):
            return self.gamma
        best = max(rates, key=lambda g: rates[g] or 0.0)
        # Keep drafting at least one token so acceptance keeps being measured.
        return max(1, best)

    def update(self, num_drafted: int, num_accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        for stat in [self.draft_cost, *self.verify_cost.values()]:
            stat.total *= self.decay
            stat.count *= self.decay
        self.acceptance.update(num_drafted, num_accepted)
        if num_drafted:
            self.draft_cost.add(draft_seconds / num_drafted)
        self.verify_cost.setdefault(num_drafted + 1, RunningMean()).add(verify_seconds)


class TreeBudgetPolicy(FixedPolicy):
    """For token trees: depth gamma, and a node budget chosen online among a few sizes (gamma,
    2 gamma, 4 gamma: one, two or four nodes per depth) by the rate each has measured, emitted
    tokens over draft + verify seconds (decayed means). So trees shrink where width does not pay
    for its verify and draft cost, and grow where it does. Each size is tried twice first, and a
    size not tried for ``revisit`` steps is tried again (deterministic: no randomness)."""

    name = "tree-cost"

    def __init__(self, gamma: int, max_budget: int = 64, decay: float = 0.9, revisit: int = 16) -> None:
        super().__init__(gamma)
        self.budgets = sorted({min(max(gamma, 1) * width, max_budget) for width in (1, 2, 4)})
        self.rates = {budget: RunningMean() for budget in self.budgets}
        self.tries = dict.fromkeys(self.budgets, 0)
        self.last_used = dict.fromkeys(self.budgets, 0)
        self.decay, self.revisit, self.steps = decay, revisit, 0
        self.node_budget = self.budgets[0]

    def next_gamma(self) -> int:
        self.steps += 1
        untried = [b for b in self.budgets if self.tries[b] < 2]
        stale = [b for b in self.budgets if self.steps - self.last_used[b] > self.revisit]
        if untried or stale:
            self.node_budget = (untried or stale)[0]
        else:
            self.node_budget = max(self.budgets, key=lambda b: self.rates[b].mean)
        self.last_used[self.node_budget] = self.steps
        return self.gamma

    def update(self, num_drafted: int, num_accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        if num_drafted == 0:
            return
        self.tries[self.node_budget] += 1
        rate = self.rates[self.node_budget]
        rate.total, rate.count = rate.total * self.decay, rate.count * self.decay
        rate.add((num_accepted + 1) / max(draft_seconds + verify_seconds, 1e-9))


POLICIES = ("fixed", "heuristic", "threshold", "cost")
TREE_POLICIES = ("tree-cost",)  # for tree drafters (with a chain drafter it is the fixed policy)


def make_policy(name: str, gamma: int) -> DraftLengthPolicy:
    """A policy by name; gamma is its starting (or, for threshold, maximum) draft length."""
    if name == "fixed":
        return FixedPolicy(gamma)
    if name == "heuristic":
        return HeuristicPolicy(gamma)
    if name == "threshold":
        return ThresholdPolicy(max_gamma=max(gamma, 8))
    if name == "cost":
        return CostModelPolicy(gamma=gamma)
    if name == "tree-cost":
        return TreeBudgetPolicy(gamma)
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES + TREE_POLICIES)}")
