"""How many tokens to draft next: fixed, heuristic, threshold and cost-model policies.

One interface: ``next_gamma()`` before a step, ``stop_early`` (a rule ``(drafted, chain_prob) ->
bool`` that model drafters consult after each token, or None for policies that never cut a draft,
so drafters skip computing the chain probability), and ``update(...)`` after verification.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol
from specdec.names import POLICIES, TREE_POLICIES


class DraftLengthPolicy(Protocol):
    name: str
    stop_early: Callable[[int, float], bool] | None
    node_budget: int | None  # for tree drafters: most nodes this step (None: the drafter's own)

    def next_gamma(self) -> int: ...

    def update(self, num_drafted: int, num_accepted: int, draft_seconds: float, verify_seconds: float,
               widths: list[int] | None = None) -> None: ...

    def for_request(self) -> DraftLengthPolicy:
        """This policy's copy for a new request. What depends on the text (acceptance, an adapted
        gamma) starts fresh; measured seconds, which depend on the models and the machine, are
        shared by the requests of one engine, so later requests do not pay to measure them again."""


class FixedPolicy:
    name = "fixed"
    stop_early = None  # never cuts a draft short
    node_budget = None  # trees keep their drafter's budget

    def __init__(self, gamma: int) -> None:
        self.gamma = gamma

    def next_gamma(self) -> int:
        return self.gamma

    def for_request(self) -> DraftLengthPolicy:
        return copy.deepcopy(self)  # nothing measured to share

    def update(self, num_drafted: int, num_accepted: int, draft_seconds: float, verify_seconds: float,
               widths: list[int] | None = None) -> None:
        """A fixed gamma learns nothing."""


class HeuristicPolicy(FixedPolicy):
    """+2 after a step whose drafts were all accepted, -1 otherwise (transformers' "heuristic")."""

    name = "heuristic"

    def __init__(self, gamma: int, max_gamma: int = 16) -> None:
        super().__init__(gamma)
        self.max_gamma = max_gamma

    def update(self, num_drafted: int, num_accepted: int, draft_seconds: float, verify_seconds: float,
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

    def stop_early(self, drafted: int, chain_probability: float) -> bool:
        return chain_probability < self.threshold

    def update(self, num_drafted: int, num_accepted: int, draft_seconds: float, verify_seconds: float,
               widths: list[int] | None = None) -> None:
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

    def forget(self, decay: float) -> None:
        """Weigh everything seen so far by ``decay`` (< 1: recent values count more)."""
        self.total *= decay
        self.count *= decay


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
            stat.forget(self.decay)
        while len(self.accepted_given_reached) < num_drafted:
            self.accepted_given_reached.append(RunningMean())
        # Positions 0..num_accepted were reached; all but the first rejected one were accepted.
        for position in range(min(num_drafted, num_accepted + 1)):
            self.accepted_given_reached[position].add(1.0 if position < num_accepted else 0.0)


@dataclass
class VerifyCost:
    """T(k), the measured seconds of a k-token verify block: a straight-line fit over the sizes
    seen (with one size seen, a mild 5% slope per token: the int8 CPU / GPU regime), or with
    ``prefer_measured`` the decayed mean where k itself was seen (trees try many sizes, and T has
    steps a line smooths over: exact bf16 blocks cost the same up to 8 tokens, then double)."""

    decay: float = 0.98
    prefer_measured: bool = False
    by_block: dict[int, RunningMean] = field(default_factory=dict)

    def add(self, block: int, seconds: float) -> None:
        for stat in self.by_block.values():
            stat.forget(self.decay)
        self.by_block.setdefault(block, RunningMean()).add(seconds)

    def seconds(self, block: int) -> float | None:
        points = [(k, m.mean) for k, m in self.by_block.items() if m.mean is not None]
        if not points:
            return None
        if self.prefer_measured and block in self.by_block and self.by_block[block].count >= 1.0:
            return self.by_block[block].mean
        if len(points) == 1:
            k0, t0 = points[0]
            return max(1e-9, t0 * (1 + 0.05 * (block - k0)))
        n = len(points)
        mean_k = sum(k for k, _ in points) / n
        mean_t = sum(t for _, t in points) / n
        var = sum((k - mean_k) ** 2 for k, _ in points)
        slope = max(0.0, sum((k - mean_k) * (t - mean_t) for k, t in points) / var)
        return max(1e-9, mean_t + slope * (block - mean_k))


@dataclass
class CostModelPolicy:
    """Draft the gamma with the highest expected tokens per second (Leviathan et al. 2023,
    with measured costs): E[tokens](g) from the per-position acceptance estimates, and
    time(g) = g * draft_cost + T(g + 1), with T(k) the measured verify cost of a k-token block."""

    gamma: int = 4  # used until there is something to estimate from
    max_gamma: int = 12
    decay: float = 0.98  # forget old steps slowly: text difficulty drifts
    name: str = "cost"
    stop_early = None  # decides the length up front; never cuts a draft short
    node_budget = None
    acceptance: AcceptanceByPosition | None = None
    draft_cost: RunningMean = field(default_factory=RunningMean)
    verify_cost: VerifyCost | None = None
    # Where no draft length beats plain decoding (measured: the llama.cpp backend on 2 cores, whose
    # verify blocks cost nearly their length in forwards): plain steps, with a one-token probe this
    # often so that acceptance keeps being measured.
    probe_every: int = 8
    plain_steps: int = 0

    def __post_init__(self) -> None:
        if self.acceptance is None:
            self.acceptance = AcceptanceByPosition(max_gamma=self.max_gamma, decay=self.decay)
        if self.verify_cost is None:
            self.verify_cost = VerifyCost(self.decay)

    def expected_rate(self, gamma: int) -> float | None:
        """Expected tokens per second when drafting gamma tokens."""
        verify = self.verify_cost.seconds(gamma + 1)
        draft = self.draft_cost.mean
        if verify is None or (gamma > 0 and draft is None):
            return None
        return self.acceptance.expected_tokens(gamma) / (gamma * (draft or 0.0) + verify)

    def for_request(self) -> CostModelPolicy:
        """Fresh acceptance estimates; the draft and verify seconds measured so far, shared."""
        return dataclasses.replace(self, acceptance=None, plain_steps=0)

    def next_gamma(self) -> int:
        rates = {g: self.expected_rate(g) for g in range(0, self.max_gamma + 1)}
        if any(rate is None for g, rate in rates.items() if g > 0):
            return self.gamma
        best = max(rates, key=lambda g: rates[g] or 0.0)
        if best > 0:
            return best
        return 1 if self.plain_steps >= self.probe_every - 1 else 0  # after probe_every - 1 plain steps, a probe

    def update(self, num_drafted: int, num_accepted: int, draft_seconds: float, verify_seconds: float,
               widths: list[int] | None = None) -> None:
        self.draft_cost.forget(self.decay)
        self.acceptance.update(num_drafted, num_accepted)
        if num_drafted:
            self.draft_cost.add(draft_seconds / num_drafted)
        self.verify_cost.add(num_drafted + 1, verify_seconds)
        self.plain_steps = 0 if num_drafted else self.plain_steps + 1  # steps in a row without a draft


@dataclass
class TreeAcceptance:
    """alpha(j, w): P(a node at depth j is accepted | depth j was reached and holds w nodes),
    decayed running means per (depth, width). Priors: width 1 inherits from the depth before
    it (as AcceptanceByPosition); a wider level starts from 1 - (1 - alpha(j, 1))^w, the rate
    of w independent guesses. That is optimistic (siblings are not independent), so a width is
    tried until its own measurements say whether it pays."""

    max_depth: int = 12
    prior_alpha: float = 0.6
    prior_weight: float = 2.0
    decay: float = 0.98
    stats: dict[tuple[int, int], RunningMean] = field(default_factory=dict)  # (depth, width)

    def alpha(self, depth: int, width: int, narrow: float) -> float:
        """narrow: alpha(depth, 1), the width-1 estimate this width's prior builds on."""
        prior = narrow if width == 1 else 1 - (1 - narrow) ** width
        stat = self.stats.get((depth, width))
        total, count = (stat.total, stat.count) if stat else (0.0, 0.0)
        return (total + prior * self.prior_weight) / (count + self.prior_weight)

    def alphas(self, width: int) -> list[float]:
        """alpha(j, width) for j < max_depth."""
        estimates, narrow = [], self.prior_alpha
        for depth in range(self.max_depth):
            narrow = self.alpha(depth, 1, narrow)
            estimates.append(narrow if width == 1 else self.alpha(depth, width, narrow))
        return estimates

    def expected_tokens(self, depth: int, width: int) -> float:
        """E[tokens emitted] by a tree of `depth` levels of `width` nodes: 1 + sum of the
        probabilities of reaching past each level."""
        expected, reach = 1.0, 1.0
        for alpha in self.alphas(width)[:depth]:
            reach *= alpha
            expected += reach
        return expected

    def update(self, widths: list[int], num_accepted: int) -> None:
        for stat in self.stats.values():
            stat.forget(self.decay)
        # Levels 0..num_accepted were reached; all but the first rejected one had a node accepted.
        for depth in range(min(len(widths), num_accepted + 1)):
            self.stats.setdefault((depth, widths[depth]), RunningMean()).add(1.0 if depth < num_accepted else 0.0)


class TreeCostPolicy(FixedPolicy):
    """For token trees: the depth and the nodes per depth (width, 1 to ``max_width``) with the
    highest expected tokens per second, from measured costs. E[tokens](d, w) from the acceptance
    per depth and width (TreeAcceptance); time(d, w) = d * draft(w) + T(d * w + 1), with draft(w)
    the measured draft seconds per depth at that width (the nearest width measured, until it is)
    and T(n) the measured verify cost of an n-token block (VerifyCost). So trees narrow where
    width does not pay for its verify and draft cost, and grow shallow where depth does not.
    The drafter gets depth d (gamma) and a node budget of d * w. Until both costs have been
    measured once, the starting shape: depth gamma, width 1."""

    name = "tree-cost"

    def __init__(self, gamma: int, max_depth: int = 8, max_width: int = 4, max_budget: int = 64,
                 decay: float = 0.98) -> None:
        super().__init__(gamma)
        self.max_depth, self.max_width, self.max_budget = max(max_depth, gamma), max_width, max_budget
        self.acceptance = TreeAcceptance(max_depth=self.max_depth, decay=decay)
        self.verify_cost = VerifyCost(decay, prefer_measured=True)
        self.draft_cost: dict[int, RunningMean] = {}  # width -> seconds per drafted depth
        self.decay = decay
        self.depth, self.width = gamma, 1
        self.node_budget = gamma

    def for_request(self) -> TreeCostPolicy:
        """Fresh acceptance estimates; the draft and verify seconds measured so far, shared."""
        fresh = TreeCostPolicy(self.gamma, self.max_depth, self.max_width, self.max_budget, self.decay)
        fresh.draft_cost, fresh.verify_cost = self.draft_cost, self.verify_cost
        return fresh

    def draft_seconds_per_depth(self, width: int) -> float | None:
        measured = [w for w, stat in self.draft_cost.items() if stat.mean is not None]
        if not measured:
            return None
        return self.draft_cost[min(measured, key=lambda w: (abs(w - width), w))].mean

    def expected_rate(self, depth: int, width: int) -> float | None:
        """Expected tokens per second of a tree of `depth` levels of `width` nodes."""
        verify = self.verify_cost.seconds(depth * width + 1)
        draft = self.draft_seconds_per_depth(width)
        if verify is None or draft is None:
            return None
        return self.acceptance.expected_tokens(depth, width) / (depth * draft + verify)

    def shapes(self) -> list[tuple[int, int]]:
        return [(depth, width) for depth in range(1, self.max_depth + 1) for width in range(1, self.max_width + 1)
                if depth * width <= self.max_budget]

    def next_gamma(self) -> int:
        rates = {shape: self.expected_rate(*shape) for shape in self.shapes()}
        if all(rate is not None for rate in rates.values()):
            self.depth, self.width = max(rates, key=lambda shape: rates[shape])
        self.node_budget = self.depth * self.width
        return self.depth

    def update(self, num_drafted: int, num_accepted: int, draft_seconds: float, verify_seconds: float,
               widths: list[int] | None = None) -> None:
        if num_drafted == 0:
            return
        # What is learned is what asking for a width gives: a drafter may deliver fewer nodes (a
        # chain drafter always one per depth, an n-gram tree as many as the text offers).
        levels = len(widths) if widths else num_drafted
        for stat in self.draft_cost.values():
            stat.forget(self.decay)
        self.acceptance.update([self.width] * levels, num_accepted)
        self.draft_cost.setdefault(self.width, RunningMean()).add(draft_seconds / levels)
        self.verify_cost.add(num_drafted + 1, verify_seconds)




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
        return TreeCostPolicy(gamma)
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES + TREE_POLICIES)}")
