"""Expected tokens per step and speedup for each draft length (Leviathan et al. 2023, sec. 3.3)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.table import Table

from specdec.core.estimates import expected_tokens_per_step, predicted_speedup


@dataclass(frozen=True)
class GammaRow:
    gamma: int
    expected_tokens: float  # E = (1 - alpha^(gamma+1)) / (1 - alpha)
    verify_cost: float  # T(gamma + 1) / T(1): the verify forward over a one-token forward
    speedup: float  # E / (gamma * c + verify_cost)


def verify_costs(costs: Sequence[float] | None, max_gamma: int) -> list[float]:
    """T(gamma+1)/T(1) for gamma = 1..max_gamma: one number for every gamma (Leviathan's
    assumption is 1: a verify block costs one forward), or one per gamma."""
    if not costs:
        return [1.0] * max_gamma
    if any(cost <= 0 for cost in costs):
        raise ValueError(f"--verify-cost values must be positive, got {list(costs)}")
    if len(costs) == 1:
        return [float(costs[0])] * max_gamma
    if len(costs) != max_gamma:
        raise ValueError(f"--verify-cost takes one value, or one per gamma 1..{max_gamma} "
                         f"({max_gamma} values), got {len(costs)}")
    return [float(cost) for cost in costs]


def speedup_table(alpha: float, c: float, max_gamma: int = 10,
                  costs: Sequence[float] | None = None) -> list[GammaRow]:
    """One row per gamma = 1..max_gamma for a draft whose tokens are each accepted with
    probability alpha and whose forward costs c target forwards."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"--alpha must lie in [0, 1], got {alpha}")
    if c < 0:
        raise ValueError(f"--c (a draft forward's cost over the target's) must be >= 0, got {c}")
    if max_gamma < 1:
        raise ValueError(f"--max-gamma must be >= 1, got {max_gamma}")
    return [GammaRow(gamma, expected_tokens_per_step(alpha, gamma), cost, predicted_speedup(alpha, gamma, c, cost))
            for gamma, cost in zip(range(1, max_gamma + 1), verify_costs(costs, max_gamma), strict=True)]


def best_row(rows: Sequence[GammaRow]) -> GammaRow:
    return max(rows, key=lambda row: row.speedup)


def calculator_table(alpha: float, c: float, rows: Sequence[GammaRow]) -> Table:
    best = best_row(rows)
    table = Table(title=f"alpha = {alpha:.4g}, c = {c:.4g}: E = (1 - alpha^(gamma+1)) / (1 - alpha), "
                        "speedup = E / (gamma c + T(gamma+1)/T(1))")
    for name in ("gamma", "expected tokens per step", "T(gamma+1)/T(1)", "speedup", ""):
        table.add_column(name, justify="right")
    for row in rows:
        marker = "best" if row is best else ""
        table.add_row(str(row.gamma), f"{row.expected_tokens:.3f}", f"{row.verify_cost:.2f}", f"{row.speedup:.3f}x",
                      marker, style="bold green" if row is best else None)
    return table
