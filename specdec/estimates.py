"""What speculation costs and gives, estimated online, and the one cost model that weighs them.

Estimators: decayed running means (``RunningMean``), acceptance per draft position
(``AcceptanceByPosition``) and per tree depth and width (``TreeAcceptance``), the seconds of a
k-token verify block for one request (``VerifyCost``) and for a batch (``VerifyCostTable``).

The cost model (Leviathan et al. 2023, with measured costs): a step of ``batch`` requests that
each draft ``depth`` levels emits ``batch * E[tokens]`` and takes ``batch * depth * draft +
T(block)``, so its rate is their ratio (``tokens_per_second``). The draft-length policies
(specdec.policy) and the server's controller (specdec.serving.speculation) both choose with it.
"""

from __future__ import annotations

import bisect
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
    """Online estimates of alpha_j = P(accept draft position j | positions before it accepted),
    decayed so that they follow the text's drifting difficulty. Each position's prior is the
    estimate of the position before it (the first's is prior_alpha), so positions never drafted
    yet inherit what was seen closer in instead of a fixed guess, and longer drafts get explored."""

    max_gamma: int = 12
    prior_alpha: float = 0.6
    prior_weight: float = 2.0
    decay: float = 0.98
    accepted_given_reached: list[RunningMean] = field(default_factory=list)
    # Another estimator whose alphas are this one's priors, position by position (a request's own
    # estimates start from the server's pooled ones and move away as its text shows itself).
    prior: AcceptanceByPosition | None = None

    def alphas(self) -> list[float]:
        priors = self.prior.alphas() if self.prior is not None else None
        estimates, prior = [], self.prior_alpha
        for position in range(self.max_gamma):
            if priors is not None:
                prior = priors[position] if position < len(priors) else prior
            stat = self.accepted_given_reached[position] if position < len(self.accepted_given_reached) else None
            total, count = (stat.total, stat.count) if stat else (0.0, 0.0)
            prior = (total + prior * self.prior_weight) / (count + self.prior_weight)
            estimates.append(prior)
        return estimates

    def reaches(self, gamma: int) -> list[float]:
        """P(draft token j is accepted) for j < gamma: the product of alpha_0 .. alpha_j."""
        reaches, reach = [], 1.0
        for alpha in self.alphas()[:gamma]:
            reach *= alpha
            reaches.append(reach)
        return reaches

    def expected_tokens(self, gamma: int) -> float:
        """E[tokens emitted by one step drafting gamma] = 1 + sum_{i<=gamma} prod_{j<=i} alpha_j."""
        return reach_sum(self.alphas()[:gamma])

    def update(self, num_drafted: int, num_accepted: int) -> None:
        for stat in self.accepted_given_reached:
            stat.forget(self.decay)
        while len(self.accepted_given_reached) < num_drafted:
            self.accepted_given_reached.append(RunningMean())
        # Positions 0..num_accepted were reached; all but the first rejected one were accepted.
        for position in range(min(num_drafted, num_accepted + 1)):
            self.accepted_given_reached[position].add(1.0 if position < num_accepted else 0.0)


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
        """E[tokens emitted] by a tree of `depth` levels of `width` nodes."""
        return reach_sum(self.alphas(width)[:depth])

    def update(self, widths: list[int], num_accepted: int) -> None:
        for stat in self.stats.values():
            stat.forget(self.decay)
        # Levels 0..num_accepted were reached; all but the first rejected one had a node accepted.
        for depth in range(min(len(widths), num_accepted + 1)):
            self.stats.setdefault((depth, widths[depth]), RunningMean()).add(1.0 if depth < num_accepted else 0.0)


def fitted_line(points: Sequence[tuple[float, float]],
                weights: Sequence[float] | None = None) -> Callable[[float], float] | None:
    """Least-squares line through (x, y) points (weighted: a point's weight is the evidence behind
    it), its slope clipped at 0 (a longer block never costs less); None when the weight sits on
    one x (no slope to fit)."""
    weights = weights or [1.0] * len(points)
    total = sum(weights)
    mean_x = sum(w * px for w, (px, _) in zip(weights, points, strict=True)) / total
    mean_y = sum(w * py for w, (_, py) in zip(weights, points, strict=True)) / total
    variance = sum(w * (px - mean_x) ** 2 for w, (px, _) in zip(weights, points, strict=True))
    if variance <= 1e-6 * total:
        return None
    slope = max(0.0, sum(w * (px - mean_x) * (py - mean_y)
                         for w, (px, py) in zip(weights, points, strict=True)) / variance)
    return lambda x: max(1e-9, mean_y + slope * (x - mean_x))


def fit_line(points: Sequence[tuple[float, float]], x: float, weights: Sequence[float] | None = None) -> float | None:
    """fitted_line evaluated at x."""
    line = fitted_line(points, weights)
    return None if line is None else line(x)


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


@dataclass
class VerifyCost:
    """T(k), the measured seconds of a k-token verify block of one request: a straight-line fit
    over the sizes seen, each weighed by its decayed count (with one size seen, or nearly all the
    weight on one, a mild 5% slope per token: the int8 CPU / GPU regime), or with
    ``prefer_measured`` the decayed mean where k itself was seen (trees try many sizes, and T has
    steps a line smooths over: exact bf16 blocks cost the same up to 8 tokens, then double).
    The weights matter: a size a policy stopped drafting keeps its old mean forever (decay scales
    its sum and count alike), so one slow sample there can tilt an unweighted line until plain
    decoding looks best, and that size is never measured again (seen once on an int4 target: the
    cost policy drafted on a run's first prompt, then only probed on the other seven; the slow
    sample itself was not captured)."""

    decay: float = 0.98
    prefer_measured: bool = False
    by_block: dict[int, RunningMean] = field(default_factory=dict)

    def add(self, block: int, seconds: float) -> None:
        for stat in self.by_block.values():
            stat.forget(self.decay)
        self.by_block.setdefault(block, RunningMean()).add(seconds)

    def seconds(self, block: int) -> float | None:
        return self.curve()(block)

    def curve(self) -> Callable[[int], float | None]:
        """T as a function of the block size, fitted once (for callers that ask many sizes a step)."""
        measured = [(k, m) for k, m in self.by_block.items() if m.mean is not None]
        if not measured:
            return lambda block: None
        points, weights = [(k, m.total / m.count) for k, m in measured], [m.count for _, m in measured]
        line = fitted_line(points, weights)
        k0, t0 = max(zip(weights, points, strict=True))[1]  # the size measured most

        def seconds(block: int) -> float | None:
            if self.prefer_measured and block in self.by_block and self.by_block[block].count >= 1.0:
                return self.by_block[block].mean
            return line(block) if line is not None else max(1e-9, t0 * (1 + 0.05 * (block - k0)))

        return seconds


class VerifyCostTable:
    """T(batch, block): seconds of one verify step for ``batch`` requests of ``block`` tokens
    each. Measured cells are decayed means; other cells are interpolated, first along the block
    length within each measured batch size, then along the batch size."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.cells: dict[tuple[int, float], RunningMean] = {}

    def add(self, batch: int, block: float, seconds: float) -> None:
        """block: tokens per row, a fraction when the rows' drafts differ in length (kept to
        halves, so that the cells stay few)."""
        cell = self.cells.setdefault((batch, round(block * 2) / 2), RunningMean())
        cell.forget(self.decay)
        cell.add(seconds)

    def estimate(self, batch: int, block: float) -> float | None:
        curve = self.curve(batch)
        return None if curve is None else curve(block)

    def curve(self, batch: int) -> Callable[[float], float] | None:
        """T(batch, block) as a function of block (mean tokens per row); None while nothing is measured."""
        by_batch: dict[int, list[tuple[float, float]]] = {}
        for (cell_batch, cell_block), cell in sorted(self.cells.items()):
            if cell.mean is not None:
                by_batch.setdefault(cell_batch, []).append((cell_block, cell.mean))
        if not by_batch:
            return None
        lines = sorted(by_batch.items())
        return lambda block: interpolate([(b, interpolate(points, block)) for b, points in lines], batch)


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
