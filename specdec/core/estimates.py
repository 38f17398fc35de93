"""What speculation costs and gives, estimated online, and the one cost model that weighs them.

Estimators: decayed means (``RunningMean``), acceptance by depth and width, chains and trees
(``AcceptanceByPosition``), T(batch, block) (``VerifyCostTable``; one request is batch 1), each
drafter's seconds per level (``DraftCost``), and where no draft pays one probe rule (``ProbeRule``).
``CostModel`` holds the seconds and the rule, one per engine (a server's engine too).

The cost model (Leviathan et al. 2023, with measured costs): a step of ``batch`` requests that
each draft ``depth`` levels emits ``batch * E[tokens]`` and takes ``batch * depth * draft +
T(batch, block)``; its rate is their ratio (``tokens_per_second``). Its clients: the policies,
the server's controller, the auto drafter and ``explain --calculator``.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field


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


def reach_sum(alphas: Sequence[float]) -> float:
    """E[tokens emitted] by a step whose levels are accepted with conditional rates ``alphas``:
    1 (the target's own token) + the probability of getting past each level."""
    expected, reach = 1.0, 1.0
    for alpha in alphas:
        reach *= alpha
        expected += reach
    return expected


@dataclass
class AcceptanceByPosition:
    """Online estimates of alpha(j, w) = P(a level at depth j is accepted | the levels before it
    were accepted and it holds w nodes): a chain's levels hold one node, a tree's ``w`` siblings.
    Decayed, so that they follow the text's drifting difficulty. Width 1's prior at each depth is
    the estimate of the depth before it (the first's is prior_alpha), so depths never drafted yet
    inherit what was seen closer in instead of a fixed guess, and longer drafts get explored. A
    wider level starts from 1 - (1 - alpha(j, 1))^w, the rate of w independent guesses: optimistic
    (siblings are not independent), so a width is tried until its own measurements say whether it
    pays."""

    max_gamma: int = 12
    prior_alpha: float = 0.6
    prior_weight: float = 2.0
    decay: float = 0.98
    accepted_given_reached: list[RunningMean] = field(default_factory=list)  # [depth], width 1
    wider: dict[tuple[int, int], RunningMean] = field(default_factory=dict)  # (depth, width > 1)
    # Another estimator whose width-1 alphas are this one's priors, depth by depth (a request's own
    # estimates start from the server's pooled ones and move away as its text shows itself).
    prior: AcceptanceByPosition | None = None

    def alphas(self, width: int = 1) -> list[float]:
        """alpha(j, width) for j < max_gamma."""
        priors = self.prior.alphas() if self.prior is not None else None
        estimates, prior = [], self.prior_alpha
        for position in range(self.max_gamma):
            if priors is not None:
                prior = priors[position] if position < len(priors) else prior
            stat = self.accepted_given_reached[position] if position < len(self.accepted_given_reached) else None
            total, count = (stat.total, stat.count) if stat else (0.0, 0.0)  # inline: this runs every step
            prior = (total + prior * self.prior_weight) / (count + self.prior_weight)
            estimates.append(prior if width == 1 else
                             self.posterior(self.wider.get((position, width)), 1 - (1 - prior) ** width))
        return estimates

    def posterior(self, stat: RunningMean | None, prior: float) -> float:
        """The decayed mean of ``stat`` with ``prior`` weighed in as prior_weight observations."""
        total, count = (stat.total, stat.count) if stat else (0.0, 0.0)
        return (total + prior * self.prior_weight) / (count + self.prior_weight)

    def reaches(self, gamma: int, width: int = 1) -> list[float]:
        """P(depth j is accepted) for j < gamma: the product of alpha_0 .. alpha_j."""
        reaches, reach = [], 1.0
        for alpha in self.alphas(width)[:gamma]:
            reach *= alpha
            reaches.append(reach)
        return reaches

    def expected_tokens(self, gamma: int, width: int = 1) -> float:
        """E[tokens emitted by one step drafting gamma levels of ``width`` nodes]
        = 1 + sum_{i<gamma} prod_{j<=i} alpha_j."""
        return reach_sum(self.alphas(width)[:gamma])

    def update(self, num_drafted: int, num_accepted: int, widths: Sequence[int] | None = None) -> None:
        """After a step: a chain of num_drafted tokens, or a tree of ``widths[j]`` nodes at depth j."""
        for stat in itertools.chain(self.accepted_given_reached, self.wider.values()):
            stat.forget(self.decay)
        levels = len(widths) if widths else num_drafted
        while len(self.accepted_given_reached) < levels:
            self.accepted_given_reached.append(RunningMean())
        # Depths 0..num_accepted were reached; all but the first rejected one had a node accepted.
        for depth in range(min(levels, num_accepted + 1)):
            width = widths[depth] if widths else 1
            stat = (self.accepted_given_reached[depth] if width == 1
                    else self.wider.setdefault((depth, width), RunningMean()))
            stat.add(1.0 if depth < num_accepted else 0.0)


def fitted_line(points: Sequence[tuple[float, float]],
                weights: Sequence[float] | None = None) -> Callable[[float], float] | None:
    """Least-squares line through (x, y) points (weighted: a point's weight is the evidence behind
    it), its slope clipped at 0 (a longer block never costs less); None when the weight sits on
    one x (no slope to fit)."""
    weights = weights or [1.0] * len(points)
    total = sum(weights)
    mean_x = sum(w * px for w, (px, _) in zip(weights, points, strict=False)) / total
    mean_y = sum(w * py for w, (_, py) in zip(weights, points, strict=False)) / total
    variance = sum(w * (px - mean_x) ** 2 for w, (px, _) in zip(weights, points, strict=False))
    if variance <= 1e-6 * total:
        return None
    pairs = zip(weights, points, strict=True)
    slope = max(0.0, sum(w * (px - mean_x) * (py - mean_y) for w, (px, py) in pairs) / variance)
    return lambda x: max(1e-9, mean_y + slope * (x - mean_x))


def interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through sorted (x, y) points; beyond the ends, the nearest segment's
    slope (never negative: a bigger forward never costs less)."""
    if len(points) == 1:
        return points[0][1]
    xs = [p[0] for p in points]
    index = min(max(bisect.bisect_left(xs, x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[index - 1], points[index]
    slope = max(0.0, (y1 - y0) / (x1 - x0))
    return max(1e-9, y0 + slope * (x - x0))


class VerifyCostTable:
    """T(batch, block): the measured seconds of one verify forward of ``batch`` requests of
    ``block`` tokens each (a policy's request is batch 1). Each cell is a decayed mean whose weight
    (decayed count) is the recent evidence behind it: a measurement forgets its batch size's cells
    a little, so a size no longer drafted fades instead of keeping its old mean forever. Within a
    batch size, T(block) is a cell's own mean where it holds one recent measurement or more (T has
    steps a line smooths over: exact bf16 blocks cost the same up to 8 tokens, then double), else a
    line fitted over the batch's cells by weight (unweighted, one old slow sample tilted it until
    plain decoding looked best on an int4 target, and that size was never measured again); with
    one size only, a 5% slope per token (the int8 CPU / GPU regime). Across batch sizes,
    piecewise-linear."""

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self.cells: dict[tuple[int, float], RunningMean] = {}

    def add(self, batch: int, block: float, seconds: float) -> None:
        """block: tokens per row, a fraction where the rows' drafts differ (kept to halves: few cells)."""
        for (cell_batch, _), cell in self.cells.items():
            if cell_batch == batch:
                cell.forget(self.decay)
        self.cells.setdefault((batch, round(block * 2) / 2), RunningMean()).add(seconds)

    def include(self, other: VerifyCostTable) -> None:
        """Each of ``other``'s cells as one measurement here (a server's startup measurement)."""
        for (batch, block), cell in sorted(other.cells.items()):
            if cell.count > 0:
                self.add(batch, block, cell.total / cell.count)

    def estimate(self, batch: int, block: float) -> float | None:
        curve = self.curve(batch)
        return None if curve is None else curve(block)

    def curve(self, batch: int) -> Callable[[float], float] | None:
        """T(batch, block) as a function of block (mean tokens per row), fitted once (callers ask
        many blocks a step); None while nothing is measured."""
        by_batch: dict[int, dict[float, RunningMean]] = {}
        for (cell_batch, cell_block), cell in self.cells.items():
            if cell.count > 0:
                by_batch.setdefault(cell_batch, {})[cell_block] = cell
        if not by_batch:
            return None
        if len(by_batch) == 1:  # one batch size measured (always, for a policy): its curve alone
            return block_curve(next(iter(by_batch.values())))
        curves = [(cell_batch, block_curve(cells)) for cell_batch, cells in sorted(by_batch.items())]
        return lambda block: interpolate([(b, curve(block)) for b, curve in curves], batch)


def block_curve(cells: Mapping[float, RunningMean]) -> Callable[[float], float]:
    """T(block) of one batch size from its cells (VerifyCostTable's rule)."""
    points, weights = [(block, cell.total / cell.count) for block, cell in cells.items()], [
        cell.count for cell in cells.values()]
    line = fitted_line(points, weights)
    k0, t0 = max(zip(weights, points, strict=False))[1]  # the size measured most
    recent = {block: cell.total / cell.count for block, cell in cells.items() if cell.count >= 1.0}

    def seconds(block: float) -> float:
        measured = recent.get(block)
        if measured is not None:
            return measured
        return line(block) if line is not None else max(1e-9, t0 * (1 + 0.05 * (block - k0)))

    return seconds


@dataclass
class DraftCost:
    """One drafter's seconds per drafted level (a chain's token, a tree's depth), keyed by the
    tree's width (1 for chains): decayed means over the steps that drafted, a step counted at most
    ``outlier`` times the mean (a step that also feeds the drafter a backlog, a new prompt or the
    tokens of undrafted steps, costs many times the others). A width not measured yet reads the
    nearest one measured (the narrower on a tie)."""

    decay: float = 0.98
    outlier: float = 3.0
    by_width: dict[int, RunningMean] = field(default_factory=dict)

    def add(self, seconds: float, levels: int, width: int = 1) -> None:
        """A step that drafted ``levels`` levels of ``width`` in ``seconds`` (none: nothing learned)."""
        if levels <= 0:
            return
        for stat in self.by_width.values():
            stat.forget(self.decay)
        stat = self.by_width.setdefault(width, RunningMean())
        per_level = seconds / levels
        stat.add(per_level if not stat.count else min(per_level, self.outlier * stat.total / stat.count))

    def seconds(self, width: int = 1) -> float | None:
        stat = self.by_width.get(width)
        if stat is not None and stat.count:
            return stat.total / stat.count
        measured = [w for w, stat in self.by_width.items() if stat.count]
        return self.by_width[min(measured, key=lambda w: (abs(w - width), w))].mean if measured else None


# A probe (a draft where none pays, to keep measuring what one would be worth) costs about this
# share of the undrafted steps between two probes, so a cheap drafter is probed often and a costly
# one seldom, within MIN_PROBE_PERIOD..CostModel.max_probe_period steps.
PROBE_SHARE = 0.03
MIN_PROBE_PERIOD = 8


@dataclass
class ProbeRule:
    """Where no draft pays, a draft once ``period`` steps in a row went without one (the period
    from CostModel.probe_period), so that what it would be worth keeps being measured (the text,
    or the load, may change). The one rule of every client: policies, the server's controller and
    each of auto's forward candidates."""

    undrafted: int = 0  # steps in a row without a draft, before this one

    def due(self, period: int) -> bool:
        return self.undrafted >= period - 1

    def observe(self, drafted: bool) -> None:
        self.undrafted = 0 if drafted else self.undrafted + 1


DRAFT = "draft"  # the name a client with one drafter gives its draft cost


@dataclass
class CostModel:
    """The one cost model of an engine: T(batch, block) (``verify``, recorded by the engine once a
    step with the step's real batch and mean block), each drafter's seconds per level (``drafts``,
    by name), one decay for every estimate and one probe period rule; a client (a policy, the
    server's controller, auto) keeps its own acceptance (it depends on the text) and asks here for
    the best draft. Seconds depend on the models and the machine, not the text: an engine's
    requests and deciders share one, and its ``clock``."""

    decay: float = 0.98
    max_probe_period: int = 64
    # seconds, for everything its clients measure (tests pass a fake clock: decisions replay exactly)
    clock: Callable[[], float] = time.perf_counter
    verify: VerifyCostTable = None  # type: ignore[assignment]  # None: a fresh table with this decay
    drafts: dict[str, DraftCost] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.verify is None:
            self.verify = VerifyCostTable(self.decay)

    def draft(self, drafter: str = DRAFT) -> DraftCost:
        return self.drafts.get(drafter) or self.drafts.setdefault(drafter, DraftCost(self.decay))

    def acceptance(self, max_gamma: int, prior: AcceptanceByPosition | None = None) -> AcceptanceByPosition:
        """Fresh acceptance estimates with this model's decay."""
        return AcceptanceByPosition(max_gamma=max_gamma, decay=self.decay, prior=prior)

    def observe_draft(self, seconds: float, levels: int, width: int = 1, drafter: str = DRAFT) -> None:
        """One step's drafting by ``drafter``: ``levels`` levels of ``width`` nodes in ``seconds``."""
        self.draft(drafter).add(seconds, levels, width)

    def probe_period(self, draft_seconds: float | None, batch: int = 1, steps: int = 1,
                     curve: Callable[[float], float] | None = None) -> int:
        """Undrafted steps before a probe of ``steps`` one-token drafts (each ``draft_seconds`` and
        T(batch, 2) - T(batch, 1)) that costs PROBE_SHARE of the T(batch, 1) steps between probes,
        within MIN_PROBE_PERIOD..max_probe_period (the longest while a cost is unknown). ``curve``:
        T(batch, block) where the caller has fitted it already (auto, every step)."""
        curve = curve if curve is not None else self.verify.curve(batch)
        if draft_seconds is None or curve is None:
            return self.max_probe_period
        probe_seconds = steps * (draft_seconds + max(0.0, curve(2) - curve(1)))
        shortest = min(MIN_PROBE_PERIOD, self.max_probe_period)
        return min(self.max_probe_period, max(shortest, round(probe_seconds / (PROBE_SHARE * curve(1)))))

    def best_chain_length(self, acceptance: AcceptanceByPosition, max_gamma: int, drafter: str = DRAFT,
                          batch: int = 1) -> int | None:
        """best_chain_length (below) of one request of a step of ``batch`` under this model's costs."""
        curve = self.verify.curve(batch)
        return best_chain_length(acceptance, self.draft(drafter).seconds(),
                                 (lambda block: None) if curve is None else curve, max_gamma)

    def best_tree_shape(self, acceptance: AcceptanceByPosition, shapes: Sequence[tuple[int, int]],
                        drafter: str = DRAFT, batch: int = 1) -> tuple[int, int] | None:
        """The (depth, width) of ``shapes`` with the most expected tokens per second for one
        request of a step of ``batch``; None until all are known."""
        curve, cost = self.verify.curve(batch), self.draft(drafter)
        if curve is None:
            return None
        alphas, rates = {width: acceptance.alphas(width) for width in {width for _, width in shapes}}, {}
        for depth, width in shapes:
            rate = tokens_per_second(reach_sum(alphas[width][:depth]), depth, cost.seconds(width),
                                     curve(depth * width + 1))
            if rate is None:
                return None
            rates[depth, width] = rate
        return max(rates, key=lambda shape: rates[shape])

    def best_draft_lengths(self, reaches: Sequence[Sequence[float]], max_gamma: int,
                           drafter: str = DRAFT) -> list[int] | None:
        """best_draft_lengths (below) of a batch with these reaches under this model's costs."""
        curve = self.verify.curve(len(reaches))
        return None if curve is None else best_draft_lengths(reaches, self.draft(drafter).seconds(), curve, max_gamma)


def tokens_per_second(expected_tokens: float, depth: float, draft_seconds: float | None,
                      verify_seconds: float | None, batch: int = 1) -> float | None:
    """The cost model: expected tokens per second of a step of ``batch`` requests, each drafting
    ``depth`` levels (a mean, when their drafts differ) at ``draft_seconds`` per drafted token and
    verified in one forward of ``verify_seconds``. None while a cost it needs is unknown."""
    if verify_seconds is None or (depth > 0 and draft_seconds is None):
        return None
    return batch * expected_tokens / (batch * depth * (draft_seconds or 0.0) + verify_seconds)


def best_chain_length(acceptance: AcceptanceByPosition, draft_seconds: float | None,
                      verify_seconds: Callable[[int], float | None], max_gamma: int, batch: int = 1) -> int | None:
    """The chain length in 0..max_gamma with the highest expected tokens per second, where
    ``verify_seconds(block)`` is T of a ``block``-token verify; None until every rate can be
    estimated (a caller drafts its default then, to measure what it costs)."""
    rates = {gamma: tokens_per_second(acceptance.expected_tokens(gamma), gamma, draft_seconds,
                                      verify_seconds(gamma + 1), batch)
             for gamma in range(max_gamma + 1)}
    known = {gamma: rate for gamma, rate in rates.items() if rate is not None}
    if len(known) < len(rates):
        return None
    return max(known, key=lambda gamma: known[gamma])


def best_draft_lengths(reaches: Sequence[Sequence[float]], draft_seconds: float | None,
                       verify_seconds: Callable[[float], float | None], max_gamma: int) -> list[int] | None:
    """Each request's draft length for one step of a batch, the lengths with the highest expected
    tokens per second: ``reaches[r][j]`` is P(request r's draft token j is accepted) (non-increasing
    in j), ``verify_seconds(block)`` T of the batch's forward at ``block`` mean tokens per row.
    A drafted token is worth its reach and costs ``draft_seconds`` plus its share of T's growth, so
    the tokens are taken in order of reach across the whole batch (a request likely to be right
    drafts longer than one that is not), and the best count of them is kept. None until every
    cost can be estimated (a caller drafts its default then, to measure what it costs)."""
    batch = len(reaches)
    # Ties go to the earlier position, so with reaches non-increasing within a request a prefix of
    # this order is a prefix of every request's draft.
    order = sorted(((reach, -position, row) for row, request_reaches in enumerate(reaches)
                    for position, reach in enumerate(request_reaches[:max_gamma])), reverse=True)
    best, best_rate, expected = 0, None, float(batch)
    for count in range(len(order) + 1):
        if count:
            expected += order[count - 1][0]
        rate = tokens_per_second(expected / batch, count / batch, draft_seconds, verify_seconds(1 + count / batch),
                                 batch)
        if rate is None:
            return None
        if best_rate is None or rate > best_rate:
            best, best_rate = count, rate
    lengths = [0] * batch
    for _, _, row in order[:best]:
        lengths[row] += 1
    return lengths


def speedup_ceiling(verify_seconds: Mapping[int, float], reach: Sequence[float] | None = None,
                    draft_fraction: float = 0.0) -> tuple[int, float]:
    """(gamma, speedup over target-only) of the best chain that verify blocks of these measured
    seconds allow: ``verify_seconds[k]`` is T(k), T(1) target-only's step; ``reach[d]`` the share
    of steps whose draft is accepted past depth d + 1 (None: every draft accepted), each draft
    token costing ``draft_fraction`` of T(1). The cost model of tokens_per_second, over T(1)'s
    rate. With every draft accepted and free, it is what no drafter can beat on this target."""
    one = verify_seconds[1]
    best = (0, 1.0)
    for block, seconds in sorted(verify_seconds.items()):
        gamma = block - 1
        if reach is not None and gamma > len(reach):
            break
        expected = 1.0 + (gamma if reach is None else sum(reach[:gamma]))
        rate = tokens_per_second(expected, gamma, draft_fraction * one, seconds)
        assert rate is not None  # both costs are given
        if rate * one > best[1]:
            best = (gamma, rate * one)
    return best


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """E[tokens] of a step drafting gamma tokens, each accepted independently with probability
    alpha: (1 - alpha^(gamma+1)) / (1 - alpha) (Leviathan et al. 2023, eq. 1)."""
    return reach_sum([alpha] * gamma)


def predicted_speedup(alpha: float, gamma: int, c: float, verify_ratio: float) -> float:
    """Leviathan et al.'s speedup over target-only decoding with the verify cost measured rather
    than assumed equal to one forward: tokens per step / (gamma * c + T(gamma+1)/T(1)), where c is
    the draft's cost per token over the target's (tokens_per_second in units of T(1))."""
    rate = tokens_per_second(expected_tokens_per_step(alpha, gamma), gamma, c, verify_ratio)
    assert rate is not None  # both costs are given
    return rate
