"""How much to speculate for the batch at hand, from measured costs (no hand-set thresholds).

A server's step runs every active request through one target forward. With b requests each
drafting g tokens, a step costs b * g * c_draft (c_draft: per drafted token, recent steps) plus
T(b, g + 1), the target forward over b blocks of g + 1 tokens, and emits b * E[tokens](g).
While the batch is small the forward is bound by reading the weights and extra tokens are
nearly free, so drafting pays; as the batch fills the forward becomes compute-bound, T grows
with every token and speculation stops paying. The controller picks, before every step, the g
in 0..gamma with the highest expected tokens per second: T measured at the first startup on a
machine over a small grid of batch sizes and block lengths (kept per machine and model in the
cache folder, so later starts take no measurement), interpolated between, and refined online
from every step, c_draft and the acceptance
per position (E[tokens]) learned online.
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from specdec.engine import Engine
from specdec.models.base import LanguageModel
from specdec.estimates import AcceptanceByPosition, VerifyCostTable, best_chain_length, tokens_per_second
from specdec.sampling import SamplingParams
from specdec.names import SPECULATION_MODES as MODES



class SpeculationController:
    """Chooses each step's draft length for the whole batch: ``on`` always drafts gamma, ``off``
    never drafts, ``auto`` maximizes expected tokens per second under the measured costs."""

    def __init__(self, mode: str, gamma: int, costs: VerifyCostTable | None = None,
                 acceptance: AcceptanceByPosition | None = None, draft_cost: float | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown speculation mode {mode!r}; choose one of {', '.join(MODES)}")
        self.mode, self.gamma = mode, gamma
        self.costs = costs or VerifyCostTable()
        self.acceptance = acceptance or AcceptanceByPosition(max_gamma=max(gamma, 1))
        # Seconds per drafted token, per request: the median of recent steps, because a step now
        # and then also feeds the draft model a backlog (a new prompt, tokens of undrafted steps).
        self.draft_costs: collections.deque[float] = collections.deque(maxlen=64)
        if draft_cost is not None:
            self.draft_costs.append(draft_cost)
        self.last_choice = 0

    @property
    def draft_cost(self) -> float | None:
        return statistics.median(self.draft_costs) if self.draft_costs else None

    def expected_rate(self, batch: int, gamma: int) -> float | None:
        """Expected emitted tokens per second of a step of ``batch`` requests drafting gamma."""
        return tokens_per_second(self.acceptance.expected_tokens(gamma), gamma, self.draft_cost,
                                 self.costs.estimate(batch, gamma + 1), batch)

    def draft_length(self, batch: int) -> int:
        if self.mode == "off" or self.gamma == 0:
            choice = 0
        elif self.mode == "on":
            choice = self.gamma
        else:
            best = best_chain_length(self.acceptance, self.draft_cost,
                                     lambda block: self.costs.estimate(batch, block), self.gamma, batch)
            # Nothing known yet (no draft cost measured): draft, and learn what it costs.
            choice = self.gamma if best is None else best
        self.last_choice = choice
        return choice

    def observe(self, batch: int, gamma: int, verify_seconds: float, draft_seconds: float,
                outcomes: Sequence[tuple[int, int]]) -> None:
        """One step's measurements: its verify time, its total draft time, and each request's
        (drafted, accepted)."""
        self.costs.add(batch, gamma + 1, verify_seconds)
        drafted = sum(num_drafted for num_drafted, _ in outcomes)
        if drafted:
            self.draft_costs.append(draft_seconds / drafted)
        for num_drafted, num_accepted in outcomes:
            if num_drafted:
                self.acceptance.update(num_drafted, num_accepted)


def profile_verify_costs(
    target: LanguageModel,
    batch_sizes: Sequence[int],
    blocks: Sequence[int],
    context: int = 64,
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
) -> VerifyCostTable:
    """T(batch, block) on ``target``: a forward of ``batch`` rows of ``block`` tokens after a
    ``context``-token prefix, the median of ``repeats``."""
    from specdec.models.timing import prefilled_cache, time_block

    table = VerifyCostTable()
    context = min(context, target.max_context - max(blocks) - 1)
    cache = prefilled_cache(target, max(batch_sizes), context)
    for batch in batch_sizes:
        for block in blocks:
            if progress is not None:
                progress(f"measuring T(batch {batch}, {block} tokens)")
            table.add(batch, block, time_block(target, cache, block, repeats, batch))
    return table


def verify_costs_key(target: LanguageModel, batch_sizes: Sequence[int], blocks: Sequence[int]) -> list:
    """What a measured T(batch, block) depends on besides the machine: the model (its files,
    backend, precision, exactness), the threads, and the grid."""
    network = target.network
    config = Path(target.path) / "config.json" if target.path else None
    stamp = config.stat().st_mtime_ns if config is not None and config.is_file() else None
    return [target.path, stamp, target.backend, str(target.dtype), str(target.device),
            getattr(network, "quantized", None), getattr(network, "fixed_rows", None),
            torch.get_num_threads(), list(batch_sizes), list(blocks)]


def cached_verify_costs(
    target: LanguageModel,
    batch_sizes: Sequence[int],
    blocks: Sequence[int],
    progress: Callable[[str], None] | None = None,
    cache_file: Path | None = None,
) -> VerifyCostTable:
    """profile_verify_costs, measured once per machine and model and kept in ``cache_file``
    (default: $SPECDEC_CACHE/verify-costs.json); a server refines the table online from then on."""
    from specdec.machine import cache_root, cached_measurement

    def measure() -> list:
        table = profile_verify_costs(target, batch_sizes, blocks, progress=progress)
        return [[batch, block, cell.mean] for (batch, block), cell in sorted(table.cells.items())]

    table = VerifyCostTable()
    for batch, block, seconds in cached_measurement(cache_file or cache_root() / "verify-costs.json",
                                                    verify_costs_key(target, batch_sizes, blocks), measure):
        table.add(batch, block, seconds)
    return table


def profile_draft_cost(engine: Engine, gamma: int, repeats: int = 3) -> float | None:
    """Seconds per drafted token of ``engine``'s drafter for one request (a one-token context,
    so a draft of gamma tokens is gamma draft steps), the fastest of ``repeats`` after a warm-up.
    None when the drafter proposes nothing here (an n-gram table finds no match)."""
    if engine.drafter is None or gamma == 0:
        return None
    timings = []
    for _ in range(repeats + 1):
        request = engine.new_request([0], SamplingParams(max_new_tokens=gamma + 1), row=0)
        started = time.perf_counter()
        draft = engine.drafter.propose(request, gamma)
        if draft.num_nodes == 0:
            return None
        timings.append((time.perf_counter() - started) / draft.num_nodes)
    return min(timings[1:])
