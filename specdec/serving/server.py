"""`specdec serve`: build the engine, the scheduler and the app, and run them under uvicorn."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the web stack and torch load only when a server is built, not for every CLI command
    from fastapi import FastAPI

    from specdec.core.drafts import Drafter
    from specdec.core.engine import Engine
    from specdec.core.estimates import VerifyCostTable
    from specdec.models.base import LanguageModel
    from specdec.serving.app import ServerLimits
    from specdec.serving.memory import KVBudget

# Prompt tokens per prefill piece in the server: on 2 CPU cores a 16-token piece of the default
# target costs a few decode steps, a 2k-token prompt ~128 pieces (so its TTFT grows by the steps
# between them).
DEFAULT_PREFILL_CHUNK = 16
# Spare cache rows holding recent prompts (serving/prefixes.py): a shared system prompt is prefilled once.
DEFAULT_PREFIX_CACHE_ROWS = 8
# Seconds running requests get to finish once the server is told to stop (serving/shutdown.py).
DEFAULT_SHUTDOWN_TIMEOUT = 10.0


def profile_grid(max_batch: int, gamma: int) -> tuple[list[int], list[int]]:
    """Batch sizes and block lengths measured at the first start: the corners the controller's
    choice hinges on (one request; a few; plain vs a full draft), interpolated between and
    extrapolated beyond; every step then refines the cell it ran. A full grid up to 32 rows took
    minutes on a 1.5B model on 2 cores before the server was ready."""
    batches = sorted({1, min(4, max_batch)})
    blocks = sorted({1, gamma + 1})
    return batches, blocks


def build_app(
    target: LanguageModel,
    drafter: Drafter | LanguageModel | None,
    model_name: str,
    gamma: int = 4,
    speculation: str = "auto",
    max_batch: int = 32,
    max_waiting: int = 1024,
    limits: ServerLimits | None = None,
    costs: VerifyCostTable | None = None,
    progress: Callable[[str], None] | None = None,
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
    prefix_cache_rows: int = DEFAULT_PREFIX_CACHE_ROWS,
    max_model_len: int | None = None,
    default_acceptance: str = "exact",
    budget: KVBudget | None = None,
    make_engine: Callable[..., Engine] | None = None,
) -> FastAPI:
    """A ready app (the scheduler starts with it). ``costs``: a measured T(batch, block) table;
    with speculation "auto" and none given, it is measured here first. ``prefill_chunk``: prompts
    go in pieces of that many tokens, as many between two decode steps as cost about half a step
    (PrefillBudget; at least one), so a long prompt does not stall the running streams; None:
    each prompt whole. ``prefix_cache_rows``: recent prompts kept in that many spare cache rows,
    whole pieces of them reused by prompts that begin the same way (0, or prefill_chunk None: off).
    ``max_model_len``: the longest request, prompt and output (None: the target's context, or the
    KV pool if smaller); longer prompts get a 400. ``default_acceptance``: for requests that name
    none ("exact"; anything else is LOSSY, docs/acceptance.md). ``budget``: the KV pool's
    (serving/memory.py; None: kv_budget()'s default, for a backend whose cache is ours).
    ``make_engine``: build_engine's keywords -> the engine (the command line's Drafting.engine), in
    place of one built on ``drafter``."""
    from specdec.assembly import build_engine
    from specdec.config import SpeculationConfig
    from specdec.core.drafts import suffix_caches
    from specdec.serving.app import create_app
    from specdec.serving.memory import kv_budget
    from specdec.serving.metrics import ServerMetrics
    from specdec.serving.scheduler import PrefillBudget, Scheduler
    from specdec.serving.speculation import SpeculationController, cached_verify_costs, profile_draft_cost

    if budget is None:
        budget = kv_budget(target, max_batch, prefix_cache_rows, max_model_len=max_model_len)
    if budget is not None:
        max_model_len = budget.max_model_len
    # The controller chooses every step's draft lengths: no request gets a policy of its own.
    if make_engine is None:
        def make_engine(**options) -> Engine:
            return build_engine(target, SpeculationConfig.of_drafter(drafter), drafter=drafter, **options)

    engine = make_engine(prefill_chunk=prefill_chunk, max_context=max_model_len, requests_choose_lengths=False)
    if engine.drafter is None:
        speculation = "off"
    if speculation == "auto" and costs is None:
        batches, blocks = profile_grid(max_batch, gamma)
        costs = cached_verify_costs(target, batches, blocks, progress=progress)
    draft_cost = profile_draft_cost(engine, gamma) if speculation == "auto" else None
    if costs is not None:  # what was measured at startup: evidence in the engine's one cost model
        engine.costs.verify.include(costs)
    controller = SpeculationController(speculation, gamma, engine.costs, draft_cost=draft_cost)
    metrics = ServerMetrics(suffix_caches(engine.drafter))
    scheduler = Scheduler(engine, controller, max_batch=max_batch, max_waiting=max_waiting, metrics=metrics,
                          prefill=PrefillBudget(), prefix_rows=prefix_cache_rows,
                          pool_tokens=None if budget is None else budget.pool_tokens)
    return create_app(scheduler, model_name, limits, metrics, default_acceptance)
