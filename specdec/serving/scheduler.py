"""Continuous batching: requests join and leave the running batch between engine steps.

One thread owns the engine and the KV cache (``max_batch`` rows drawing on one pool of blocks).
Each loop: admit waiting requests into free rows while the pool holds their prompts, feed the
prompts of those still prefilling (a prompt admitted alone whole; else, shortest first, pieces
under a token budget, PrefillBudget, so a long prompt stalls neither the running streams nor the
requests admitted beside it), ask the controller how much each request drafts, make room in the
pool for every step (stored prompts go first, then the youngest request is preempted: its blocks
freed, its context computed again when it is admitted again, its text unchanged), run one engine
step for every running request, hand each request's chunk to its ``emit`` callback, and free the
rows (and blocks) of finished or cancelled requests. Callers on other threads only submit and
cancel; ``emit`` runs on the scheduler thread and must not block.

An error raised for one request (building it, its prefill's drafter hooks, its drafter, its grammar
matcher, its text) ends that request alone (Scheduler.fail: its ``emit`` gets the error, the
server's log the traceback): the engine leaves it out of the step and the others go on. Only an
error of the shared step itself (the target's forward) ends every request it held.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specdec.core.engine import Engine, Request
from specdec.core.estimates import RunningMean
from specdec.core.request import NOT_ISOLATED
from specdec.core.sampling import SamplingParams
from specdec.grammar import TokenMatcher
from specdec.models.base import ForkingCache
from specdec.models.paged_cache import BLOCK_SIZE, CacheFullError, PagedKVCache
from specdec.serving.admission import ShuttingDown
from specdec.serving.metrics import ServerMetrics
from specdec.serving.prefixes import PrefixCache
from specdec.serving.speculation import SpeculationController
from specdec.text import StreamChunk, TextStream, step_chunk

Emit = Callable[[StreamChunk | BaseException], None]
log = logging.getLogger("specdec.serving")



class QueueFullError(RuntimeError):
    """More requests are waiting than the server accepts."""


@dataclass(eq=False)
class Ticket:
    """One submitted request, as its caller sees it."""

    prompt_ids: list[int]
    sampling: SamplingParams
    emit: Emit
    id: int = 0
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    request: Request | None = None  # set once admitted into a cache row
    text: TextStream | None = None
    last_emit: float | None = None
    # A request of the same prompt submitted before (OpenAI's n): while it prefills, this one waits
    # and then starts from a copy of its cache row (Engine.prefill's forks), if the cache can fork.
    parent: Ticket | None = None
    matcher: TokenMatcher | None = None  # its constraint's, compiled before it was submitted
    preempted: int = 0  # times its cache row was taken back while the pool ran dry (its text goes on)

    def admitted(self) -> Request:
        """Its request, for a ticket that holds a cache row (prefilling or running)."""
        if self.request is None:
            raise RuntimeError(f"request {self.id} holds no cache row")
        return self.request

    def streaming(self) -> TextStream:
        """Its text stream, for a running ticket (prefill done)."""
        if self.text is None:
            raise RuntimeError(f"request {self.id} is not running")
        return self.text


@dataclass
class PrefillBudget:
    """How many prompt tokens a loop feeds: ``tokens`` when given, else, while streams run, as
    many as cost ``share`` of a decode step, and while none runs, as many as cost ``alone_seconds``
    (from the measured seconds of both, decayed means; before any measurement, ``initial``). The
    engine feeds whole pieces (Engine.prefill, at least one), so a running stream's inter-token
    time grows by about ``share`` while a long prompt prefills, or by one piece where a piece
    costs more; and a request that arrives while a long prompt prefills alone is admitted within
    about ``alone_seconds`` (a loop admits newcomers before it feeds)."""

    tokens: int | None = None
    share: float = 0.5
    alone_seconds: float = 0.25
    initial: int = 1
    decay: float = 0.9
    step_seconds: RunningMean = field(default_factory=RunningMean)
    seconds_per_token: RunningMean = field(default_factory=RunningMean)

    def __post_init__(self) -> None:
        if self.tokens is not None and self.tokens < 1:
            raise ValueError(f"a prefill budget needs at least one token, got {self.tokens}")

    def next(self, streams_running: bool = True) -> int:
        if self.tokens is not None:
            return self.tokens
        step, per_token = self.step_seconds.mean, self.seconds_per_token.mean
        seconds = (None if step is None else self.share * step) if streams_running else self.alone_seconds
        if seconds is None or per_token is None:
            return self.initial
        return max(1, int(seconds / per_token))

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens:
            self.seconds_per_token.forget(self.decay)
            self.seconds_per_token.add(seconds / tokens, tokens)

    def observe_step(self, seconds: float) -> None:
        self.step_seconds.forget(self.decay)
        self.step_seconds.add(seconds)


class Scheduler:
    def __init__(self, engine: Engine, controller: SpeculationController, max_batch: int = 32,
                 max_waiting: int = 1024, metrics: ServerMetrics | None = None,
                 prefill: PrefillBudget | None = None, prefix_rows: int = 0, pool_tokens: int | None = None,
                 ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if prefix_rows < 0:
            raise ValueError(f"prefix_rows must be >= 0, got {prefix_rows}")
        if controller.mode == "auto" and controller.costs is not engine.costs:  # one decision-maker per engine
            raise ValueError("the speculation controller must decide with its engine's cost model "
                             "(SpeculationController(..., costs=engine.costs)), where the engine records T")
        self.engine, self.controller, self.metrics = engine, controller, metrics
        self.prefill = prefill or PrefillBudget()
        self.max_batch, self.max_waiting = max_batch, max_waiting
        # Rows of at most the engine's longest request (a server's --max-model-len), all in one pool
        # of blocks (serving/memory.py; default: room for every row's longest), where the backend's
        # cache is ours; else the backend's own.
        rows = max_batch + prefix_rows
        pool_tokens = pool_tokens or rows * (engine.max_context + BLOCK_SIZE)  # (a block each for rounding)
        pooled = engine.target.new_paged_cache(rows, pool_tokens, engine.max_context)
        self.cache = pooled or engine.target.new_cache(rows=rows, max_length=engine.max_context)
        self.pool = pooled if isinstance(pooled, PagedKVCache) else None
        self.free_rows = list(range(max_batch))
        # Recent prompts in prefix_rows spare rows (exact only where prompts go in whole pieces)
        self.prefixes = (PrefixCache(self.cache, list(range(max_batch, max_batch + prefix_rows)), engine.prefill_chunk)
                         if prefix_rows and engine.prefill_chunk and isinstance(self.cache, ForkingCache) else None)
        self.waiting: collections.deque[Ticket] = collections.deque()
        self.prefilling: list[Ticket] = []  # admitted, prompt not all in the cache yet
        self.running: list[Ticket] = []
        # (prompt tokens fed, streams running) of the last loops that fed (bounded: a server runs for days)
        self.prefill_chunks: collections.deque[tuple[int, int]] = collections.deque(maxlen=4096)
        self.passed_over: set[Request] = set()  # prefilling requests the last loop fed nothing of
        # Each prefilling request's last loop that fed it (or, before any, the loop that first saw it):
        # the passed over go least recently fed first, so none waits more loops than there are prompts.
        self.last_fed: dict[Request, int] = {}
        self.feed_loops = 0
        # (batch, mean draft length) -> steps
        self.steps: collections.Counter[tuple[int, float]] = collections.Counter()
        self.ids = itertools.count()
        self.wake = threading.Condition()
        self.stopping = False
        self.aborting: BaseException | None = None  # set by abort(): every request from then on ends with it
        self.thread = threading.Thread(target=self.loop, name="specdec-scheduler", daemon=True)

    def start(self) -> Scheduler:
        self.thread.start()
        return self

    def stop(self) -> None:
        with self.wake:
            self.stopping = True
            self.wake.notify()
        self.thread.join()

    def abort(self, error: BaseException) -> None:
        """End every request held (waiting, prefilling or running) with ``error``, and every one
        submitted from now on, at the next loop (a shutdown's end of grace: serving/shutdown.py)."""
        with self.wake:
            self.aborting = error
            self.wake.notify()

    def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams, emit: Emit) -> Ticket:
        """Queue a request; its chunks go to ``emit``. Raises ValueError for a prompt the
        engine cannot take and QueueFullError when too many requests wait."""
        return self.submit_choices(prompt_ids, [sampling], [emit])[0]

    def submit_choices(self, prompt_ids: Sequence[int], samplings: Sequence[SamplingParams],
                       emits: Sequence[Emit], matchers: Sequence[TokenMatcher | None] | None = None) -> list[Ticket]:
        """Queue one request per sampling of one prompt (OpenAI's n), together: the first
        prefills the prompt and the others, admitted beside it, start from copies of its cache
        row (a choice admitted later, when rows were short, prefills itself). ``matchers``: each
        choice's compiled constraint (None: compiled when admitted, on this scheduler's thread)."""
        ids = self.engine.check_prompt(prompt_ids)
        tickets: list[Ticket] = []
        for sampling, emit, matcher in zip(samplings, emits, matchers or [None] * len(samplings), strict=True):
            tickets.append(Ticket(ids, sampling, emit, id=next(self.ids), parent=tickets[0] if tickets else None,
                                  matcher=matcher))
        with self.wake:
            if len(self.waiting) + len(tickets) > self.max_waiting:
                raise QueueFullError(f"{len(self.waiting)} requests are waiting (the limit is {self.max_waiting}); "
                                     "retry later")
            self.waiting.extend(tickets)
            self.wake.notify()
        return tickets

    def cancel(self, ticket: Ticket) -> None:
        """Stop ``ticket``: its row is freed before the next step."""
        with self.wake:
            ticket.cancelled = True
            if ticket in self.waiting:
                self.waiting.remove(ticket)
            self.wake.notify()

    @property
    def load(self) -> tuple[int, int]:
        """(running, waiting) requests; a prefilling request counts as running."""
        return len(self.running) + len(self.prefilling), len(self.waiting)

    def loop(self) -> None:
        while True:
            with self.wake:
                while not self.stopping and not self.waiting and not self.running and not self.prefilling:
                    self.wake.wait()
                if self.stopping:
                    return
                ending: list[tuple[Ticket, BaseException]] = []
                if self.aborting is not None:
                    ending = [(ticket, self.aborting)
                              for ticket in dict.fromkeys([*self.waiting, *self.prefilling, *self.running])]
                    self.waiting.clear()
                admitted = [] if ending else self.admissible()
            for ticket, error in ending:
                self.fail(ticket, error)
            if ending:
                continue
            try:
                self.advance(admitted)
            except NOT_ISOLATED:
                raise
            except BaseException as error:  # noqa: BLE001 - a failed step fails its requests, not the server
                for ticket in dict.fromkeys([*self.running, *self.prefilling, *(ticket for ticket, _ in admitted)]):
                    self.fail(ticket, error)
                # Every newcomer's row is free again (also one whose request could not be built).
                self.free_rows = list(set(self.free_rows).union(row for _, row in admitted))
            if self.metrics is not None:
                self.metrics.set_load(*self.load)

    def advance(self, admitted: list[tuple[Ticket, int]]) -> None:
        """Admit the newcomers (ticket, free row), feed prompts, then one step for every running request."""
        built = []
        for ticket, row in admitted:
            if ticket.request is not None:  # preempted before: its row's entries are computed again
                self.resume(ticket, row)
                continue
            try:  # a constraint the grammar engine refuses, a drafter's start, fail their own request only
                ticket.request = self.engine.new_request(ticket.prompt_ids, ticket.sampling, row, ticket.matcher)
                built.append((ticket, row))
            except NOT_ISOLATED:
                raise
            except BaseException as error:  # noqa: BLE001 - see Isolation
                self.fail(ticket, error)
                self.free_rows.append(row)
        admitted[:] = built
        self.prefilling.extend(ticket for ticket, _ in built)
        for ticket, _ in built:
            if self.prefixes is not None and ticket.request is not None and not self.forks_later(ticket):
                reused = self.prefixes.reuse(ticket.request)
                if self.metrics is not None:
                    self.metrics.observe_prefix_query(reused)
            if self.pool is not None and not self.forks_later(ticket):  # its prompt's blocks, held from now on
                try:
                    self.pool.hold(ticket.admitted().row, len(ticket.prompt_ids))
                except CacheFullError as error:  # has_room saw them: only a pool smaller than one prompt
                    self.fail(ticket, error)
        for ticket in [t for t in [*self.prefilling, *self.running] if t.cancelled]:
            if self.metrics is not None:
                self.metrics.finished("abort")
            self.release(ticket)
        if self.prefilling:
            try:
                self.feed_prompts()
            except NOT_ISOLATED:
                raise
            except BaseException as error:  # noqa: BLE001 - the prompts being fed fail, the running streams go on
                for ticket in list(self.prefilling):
                    self.fail(ticket, error)
        if not self.running:
            return
        draft_lengths = self.make_room(self.controller.draft_lengths([ticket.admitted() for ticket in self.running]))
        batch = [ticket.admitted() for ticket in self.running]
        self.steps[len(batch), self.controller.last_choice] += 1
        lengths = [request.length for request in batch]
        drafted_before = [request.stats.draft_seconds for request in batch]
        started = time.perf_counter()
        failed: dict[Request, BaseException] = {}  # requests that raised: they end, the others go on
        outcomes = self.engine.step(batch, self.cache, draft_lengths, failed)
        seconds = time.perf_counter() - started
        stepped = [(ticket, length, before)
                   for ticket, length, before in zip(list(self.running), lengths, drafted_before, strict=True)
                   if ticket.admitted() not in failed]
        for ticket in [ticket for ticket in self.running if ticket.admitted() in failed]:
            if isinstance(failed[ticket.admitted()], CacheFullError):  # a block more than make_room saw
                self.preempt(ticket)
            else:
                self.fail(ticket, failed[ticket.admitted()])
        batch = [ticket.admitted() for ticket, _, _ in stepped]
        self.prefill.observe_step(seconds)
        draft_seconds = sum(request.stats.draft_seconds - before
                            for request, (_, _, before) in zip(batch, stepped, strict=True))
        self.controller.observe(batch, draft_seconds,
                                # a grammar's forced tokens are not the drafter's guesses
                                [(0, 0) if o.forced else (o.num_drafted, o.num_accepted) for o in outcomes])
        now = time.perf_counter()
        if self.metrics is not None:
            self.metrics.observe_step(len(batch), self.controller.last_choice, outcomes)
        for (ticket, length, _), outcome in zip(stepped, outcomes, strict=True):
            try:
                chunk = step_chunk(ticket.admitted(), outcome, length, ticket.streaming(), ticket.submitted)
            except NOT_ISOLATED:
                raise
            except BaseException as error:  # noqa: BLE001 - its text failed: it alone ends
                self.fail(ticket, error)
                continue
            if self.metrics is not None:
                self.metrics.observe_chunk(len(chunk.token_ids), now, ticket.submitted, ticket.last_emit)
            ticket.last_emit = now
            ticket.emit(chunk)
            finish_reason = ticket.admitted().finish_reason
            if finish_reason is not None:
                if self.metrics is not None:
                    self.metrics.finished(finish_reason)
                self.release(ticket)

    def admissible(self) -> list[tuple[Ticket, int]]:
        """The waiting tickets to admit now, in order, each with a free row: while rows are free
        and the pool holds them (has_room; the rest wait for blocks to come back)."""
        admitted: list[tuple[Ticket, int]] = []
        while self.waiting and self.free_rows and self.has_room(self.waiting[0], [t for t, _ in admitted]):
            admitted.append((self.waiting.popleft(), self.free_rows.pop()))
        return admitted

    def has_room(self, ticket: Ticket, admitting: list[Ticket]) -> bool:
        """Whether the pool holds ``ticket``'s context (its prompt, or all a preempted one had)
        beside those being admitted with it and a block for each request's next step, stored
        prompts given up if need be. Alone it is always admitted (a prompt fits the pool:
        serving/memory.py)."""
        if self.pool is None:
            return True
        pool = self.pool

        def context(waiting: Ticket) -> int:
            return pool.blocks_for(len(waiting.prompt_ids) if waiting.request is None else waiting.request.length)

        need = sum(map(context, [*admitting, ticket])) + len(self.running) + len(self.prefilling) + len(admitting) + 1
        while pool.free_block_count < need and self.prefixes is not None and self.prefixes.evict_oldest():
            pass
        return pool.free_block_count >= need or not (self.running or self.prefilling or admitting)

    def make_room(self, draft_lengths: list[int]) -> list[int]:
        """The blocks every running request's step needs (its block of draft_lengths + 1 tokens):
        stored prompts go first, then the youngest requests are preempted until the rest fit.
        Returns the draft lengths of the requests still running."""
        if self.pool is None:
            return draft_lengths
        pool = self.pool

        def need() -> int:
            return sum(pool.blocks_needed(t.admitted().row, t.admitted().length + d)
                       for t, d in zip(self.running, draft_lengths, strict=True))

        while need() > pool.free_block_count:
            if self.prefixes is not None and self.prefixes.evict_oldest():
                continue
            # The youngest request goes: running, preempted (its context computed again later), or
            # still prefilling (its prompt's held blocks), deferred: it starts again from its prompt.
            feeding = [ticket for ticket in self.prefilling if not self.forks_later(ticket)]
            youngest = max([*self.running, *feeding], key=lambda ticket: ticket.id)
            if youngest in feeding:
                self.defer(youngest)
                continue
            if len(self.running) == 1:
                break  # alone it fits (max_model_len <= the pool); a tree's extra nodes: see advance
            index = self.running.index(youngest)
            self.preempt(youngest)
            draft_lengths = draft_lengths[:index] + draft_lengths[index + 1 :]
        return draft_lengths

    def defer(self, ticket: Ticket) -> None:
        """A prefilling ``ticket`` back to the queue's front with nothing of it kept (it has emitted
        nothing): its row and held blocks freed, its request built again when admitted, so its
        text is what it gets alone."""
        self.release(ticket)
        ticket.preempted += 1
        log.info("request %d deferred (KV pool dry while its prompt was fed)", ticket.id)
        if self.metrics is not None:
            self.metrics.preemptions.inc()
        with self.wake:
            self.waiting.appendleft(ticket)

    def preempt(self, ticket: Ticket) -> None:
        """Take ``ticket``'s cache row back (its blocks freed) and queue it first: admitted again,
        its context is computed again (resume) and its text goes on as if never stopped."""
        request = ticket.admitted()
        self.running.remove(ticket)
        self.cache.rollback(request.row, 0)
        self.free_rows.append(request.row)
        ticket.preempted += 1
        log.info("request %d preempted (KV pool dry), %d tokens to recompute", ticket.id, request.length)
        if self.metrics is not None:
            self.metrics.preemptions.inc()
        with self.wake:
            self.waiting.appendleft(ticket)

    def resume(self, ticket: Ticket, row: int) -> None:
        """A preempted ticket in its new row: its context fed again (Engine.refill), running again."""
        request = ticket.admitted()
        request.row = row
        try:
            self.cache.ensure(row, request.length)
            self.engine.refill(request, self.cache)
        except NOT_ISOLATED:
            raise
        except BaseException as error:  # noqa: BLE001 - see Isolation
            self.fail(ticket, error)
            return
        self.running.append(ticket)

    def feed_prompts(self) -> None:
        """Feed the prefilling requests' prompts: the next PrefillBudget tokens (a prompt alone
        too, so that one arriving during it is admitted at the next loop), shortest prompt first
        (so a short one admitted beside a long one starts at once), the requests the last loop
        passed over first of all, least recently fed first (ties: in the order they came): so a long one
        still moves while short ones keep coming, and a short one admitted while several long
        ones are fed waits a loop or two, never for them to end (the order they came in let long
        prompts that took turns pass over a newcomer until they were done). Of the prompts that need
        more than one piece, only the one with the least left is put first when passed over: the
        others wait their turn, so long prompts end one after another (taking turns ended them all
        at the end). With nothing running, the prompts that fit in one piece all go in at once
        besides (a burst starts together, as it would alone). An engine without pieces
        (prefill_chunk None) feeds every prompt whole. The requests done start running."""
        forking = [ticket for ticket in self.prefilling if self.forks_later(ticket)]
        forks = [(ticket.parent.request, ticket.admitted()) for ticket in forking
                 if ticket.parent is not None and ticket.parent.request is not None]
        requests = [ticket.admitted() for ticket in self.prefilling if ticket not in forking]
        left = {request: len(request.prompt_ids) - 1 - request.fed for request in requests}
        loop = self.feed_loops
        self.feed_loops += 1
        for request in requests:
            self.last_fed.setdefault(request, loop)
        # Of the prompts that need more than one piece, only the one with the least left (ties: the first
        # that came) goes first when passed over; the others wait their turn behind it, so long prompts end
        # one after another, as soon as they can, rather than all at the end by taking turns.
        chunk = self.engine.prefill_chunk
        several = [request for request in requests if chunk is not None and left[request] > chunk]
        waiting_turn = set(several) - {min(several, key=left.__getitem__)} if several else set()
        # Stable: the passed over least recently fed first, ties in the order they came; then shortest first.
        requests.sort(key=lambda r: (0, self.last_fed[r]) if r in self.passed_over and r not in waiting_turn
                      else (1, left[r]))
        budget = None
        if self.engine.prefill_chunk is not None:  # in pieces: a loop's worth, and newcomers admitted between loops
            budget = self.prefill.next(streams_running=bool(self.running))
            if not self.running:
                budget += sum(count for count in left.values() if count <= self.engine.prefill_chunk)
        fed_before = [request.fed for request in requests]
        started = time.perf_counter()
        done = self.engine.prefill(requests, self.cache, budget, forks,
                                   None if self.prefixes is None else self.prefixes.store)
        fed = sum(request.fed for request in requests) - sum(fed_before)
        self.passed_over = {r for r, before in zip(requests, fed_before, strict=True)
                            if r.fed == before and r not in done}
        for request, before in zip(requests, fed_before, strict=True):
            if request in done:
                self.last_fed.pop(request, None)
            elif request.fed > before:
                self.last_fed[request] = loop
        self.prefill.observe_prefill(fed, time.perf_counter() - started)
        if self.metrics is not None:
            self.metrics.observe_prefill(fed, sum(child.fed for _, child in forks if child in done))
        if fed:
            self.prefill_chunks.append((fed, len(self.running)))
        for ticket in [t for t in self.prefilling if t.request in done]:
            ticket.text = TextStream(self.engine.target.tokenizer, ticket.sampling.stop)
            self.prefilling.remove(ticket)
            self.running.append(ticket)
            if self.pool is not None:  # running, its blocks come and go with its steps (make_room)
                self.pool.release_hold(ticket.admitted().row)

    def forks_later(self, ticket: Ticket) -> bool:
        """Whether ``ticket`` waits for its parent's prefill to copy it (else it prefills itself:
        no parent, a parent gone or already decoding, or a cache that cannot fork)."""
        return (ticket.parent is not None and ticket.parent in self.prefilling and ticket.request is not None
                and ticket.request.fed == 0 and isinstance(self.cache, ForkingCache))

    def fail(self, ticket: Ticket, error: BaseException) -> None:
        """End ``ticket`` with ``error``: its row is freed, then its caller gets the error (so a
        caller that heard of it finds the row free), the log its traceback (a shutdown's end: one
        line, since nothing went wrong)."""
        if isinstance(error, ShuttingDown):
            log.warning("request %d ended by the shutdown (%d tokens generated)", ticket.id,
                        0 if ticket.request is None else len(ticket.request.generated_ids))
        else:
            log.error("request %d failed: %r", ticket.id, error, exc_info=error)
        if self.metrics is not None:
            self.metrics.finished("error")
        self.release(ticket)
        ticket.emit(error)

    def release(self, ticket: Ticket) -> None:
        """Give the ticket's cache row back (its contents are forgotten) and drop its state."""
        for queue in (self.running, self.prefilling):
            if ticket in queue:
                queue.remove(ticket)
        if ticket.request is not None:
            self.cache.rollback(ticket.request.row, 0)
            self.free_rows.append(ticket.request.row)
            self.passed_over.discard(ticket.request)
            self.last_fed.pop(ticket.request, None)
            ticket.request = None  # the drafter's per-request state (a draft cache) goes with it
