"""How much to speculate for the batch at hand, from measured costs (no hand-set thresholds).

A server's step runs every active request through one target forward. With b requests drafting
g_1 .. g_b tokens, a step costs (sum g_r) * c_draft (c_draft: per drafted token, recent steps)
plus T(b, 1 + mean g), the target forward over the b blocks, and emits b + the sum of each
drafted token's reach (the chance that it and the tokens before it are accepted). While the batch
is small the forward is bound by reading the weights and extra tokens are nearly free, so
drafting pays; as the batch fills the forward becomes compute-bound, T grows with every token and
speculation stops paying. Before every step the controller gives each request its draft length,
together the highest expected tokens per second (estimates.CostModel, the cost model the
``cost`` policy also uses): a request whose text the drafter guesses well drafts longer than one
it does not. T is measured at the first startup on a machine over a small grid of batch sizes and
block lengths (kept per machine and model in the cache folder, so later starts take no
measurement), interpolated between, and refined online from every step; c_draft and the
acceptance per position, pooled and per request, are learned online. The server's choice is the
only one: its engine gives requests no draft-length policy (build_engine(requests_choose_lengths=False)).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from specdec.core.engine import Engine
from specdec.core.estimates import AcceptanceByPosition, CostModel, ProbeRule, VerifyCostTable
from specdec.core.sampling import SamplingParams
from specdec.models.base import LanguageModel
from specdec.names import SPECULATION_MODES as MODES


class SpeculationController:
    """Chooses each step's draft length for every request of the batch: ``on`` always drafts
    gamma, ``off`` never drafts, ``auto`` maximizes the batch's expected tokens per second under
    the measured costs (estimates.CostModel.best_draft_lengths), from each request's own acceptance.
    ``costs``: its engine's one cost model (Engine.costs), where the engine records every step's
    verify seconds and an auto drafter its candidates' seconds."""

    def __init__(self, mode: str, gamma: int, costs: CostModel | None = None,
                 acceptance: AcceptanceByPosition | None = None, draft_cost: float | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown speculation mode {mode!r}; choose one of {', '.join(MODES)}")
        self.mode, self.gamma = mode, gamma
        self.costs = costs if costs is not None else CostModel()
        # Pooled over every request: a new request's estimates start from it.
        self.acceptance = acceptance or self.costs.acceptance(max(gamma, 1))
        self.by_request: weakref.WeakKeyDictionary[object, AcceptanceByPosition] = weakref.WeakKeyDictionary()
        if draft_cost is not None:  # measured at startup: one step's worth of evidence
            self.costs.draft().add(draft_cost, 1)
        # Where drafting does not pay, a one-token probe now and then keeps the acceptance measured.
        self.probe = ProbeRule()
        self.last_choice = 0.0  # the last step's mean draft length

    def acceptance_of(self, request: object) -> AcceptanceByPosition:
        """``request``'s own acceptance estimates (its prior: the pooled ones)."""
        own = self.by_request.get(request)
        if own is None:
            own = self.by_request[request] = self.costs.acceptance(self.acceptance.max_gamma, prior=self.acceptance)
        return own

    def draft_lengths(self, requests: Sequence[object]) -> list[int]:
        """This step's draft length for each of ``requests`` (the batch, in order)."""
        if self.mode == "off" or self.gamma == 0:
            lengths = [0] * len(requests)
        elif self.mode == "on":
            lengths = [self.gamma] * len(requests)
        else:
            reaches = [self.acceptance_of(request).reaches(self.gamma) for request in requests]
            best = self.costs.best_draft_lengths(reaches, self.gamma) if requests else None
            # Nothing known yet (no draft cost measured): draft, and learn what it costs.
            lengths = [self.gamma] * len(requests) if best is None else best
            period = self.costs.probe_period(self.costs.draft().seconds(), len(requests))
            if not any(lengths) and self.probe.due(period) and requests:
                lengths[max(range(len(requests)), key=lambda index: reaches[index][0])] = 1
            self.probe.observe(any(lengths))
        self.last_choice = sum(lengths) / max(1, len(lengths))
        return lengths

    def observe(self, requests: Sequence[object], draft_seconds: float, outcomes: Sequence[tuple[int, int]]) -> None:
        """One step's measurements: its total draft time and each request's (drafted, accepted)
        (its verify time the engine recorded in the cost model)."""
        drafted = sum(num_drafted for num_drafted, _ in outcomes)
        self.costs.observe_draft(draft_seconds, drafted)
        for request, (num_drafted, num_accepted) in zip(requests, outcomes, strict=True):
            if num_drafted:
                self.acceptance.update(num_drafted, num_accepted)
                self.acceptance_of(request).update(num_drafted, num_accepted)


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
