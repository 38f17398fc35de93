"""A run's allowance of wall-clock time (`specdec train-head --hours`): long work (generating the
target's continuations, extracting features, training) checks it between whole pieces, each saved
when done, and stops with BudgetSpent when it is used up; the same command then goes on from the
last saved piece. A session that may end at any time loses at most one piece."""

from __future__ import annotations

import time
from collections.abc import Callable


class BudgetSpent(Exception):
    """The run's --hours are used up; everything done so far is saved."""


class Budget:
    def __init__(self, hours: float | None) -> None:
        self.hours = hours
        self.started = time.monotonic()

    def spent(self) -> bool:
        return self.hours is not None and time.monotonic() - self.started >= self.hours * 3600

    def check(self, where: str, before_stopping: Callable[[], None] | None = None) -> None:
        """Once the allowance is used up: ``before_stopping`` (to save what is done), then BudgetSpent
        saying ``where`` the run stopped."""
        if self.spent():
            if before_stopping is not None:
                before_stopping()
            allowance = "the budget" if self.hours is None else f"--hours {self.hours:g}"
            raise BudgetSpent(f"{allowance} spent {where}")


UNLIMITED = Budget(None)
