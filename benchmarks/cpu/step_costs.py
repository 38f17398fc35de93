"""What each verify step of a `specdec bench` run cost, by block size: the run as the CLI makes it,
with every step's drafted tokens, emitted tokens, drafter and verify seconds recorded as the engine
advances a request (Engine.advance wrapped for the run; nothing else changes).

    python benchmarks/cpu/step_costs.py STEPS.json bench --target DIR --suite humaneval --limit 10 \\
        --methods auto --repeats 1 --out runs/he10

Prints, per block size k (drafted + 1), the steps, their median and total verify seconds, the
tokens a step emitted and the drafters; STEPS.json keeps every step. target-only's steps are the
k = 1 rows without a drafter.
"""

from __future__ import annotations

import collections
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

import specdec.core.engine as engine_module
from specdec.commands.cli import main as cli_main


def run_with_steps(arguments: list[str], on_step: Callable[[Any, Any, float, float], None]) -> None:
    """Run `specdec ARGUMENTS` with Engine.advance wrapped: on_step(request, outcome, draft_seconds,
    verify_seconds) after each step is applied (restored when the run ends)."""
    advance = engine_module.Engine.advance

    def recorded(self, request, outcome, draft_seconds, verify_seconds):
        advance(self, request, outcome, draft_seconds, verify_seconds)
        on_step(request, outcome, draft_seconds, verify_seconds)

    engine_module.Engine.advance = recorded
    sys.argv = ["specdec", *arguments]
    try:
        cli_main()
    except SystemExit:
        pass
    finally:
        engine_module.Engine.advance = advance


def main() -> None:
    out, arguments = sys.argv[1], sys.argv[2:]
    steps: list[tuple[int, int, str | None, float, float]] = []
    run_with_steps(arguments, lambda request, outcome, draft_seconds, verify_seconds: steps.append(
        (outcome.num_drafted, len(outcome.emitted), outcome.drafter, draft_seconds, verify_seconds)))
    with open(out, "w") as file:
        json.dump([dict(zip(("drafted", "emitted", "drafter", "draft_seconds", "verify_seconds"), step, strict=True))
                   for step in steps], file)
    by_block: dict[int, list] = collections.defaultdict(list)
    for step in steps:
        by_block[step[0] + 1].append(step)
    for block in sorted(by_block):
        rows = by_block[block]
        drafters = collections.Counter(step[2] for step in rows).most_common(3)
        print(f"k={block:3d}  steps {len(rows):5d}  verify median {statistics.median(s[4] for s in rows) * 1e3:6.1f} ms"
              f"  total {sum(s[4] for s in rows):6.1f} s  emitted a step {statistics.mean(s[1] for s in rows):5.2f}"
              f"  drafters {drafters}")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
