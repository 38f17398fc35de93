"""The HTTP server: OpenAI-compatible routes over a continuous-batching Scheduler.

Handlers run on the event loop and never touch the engine: they submit a request and read its
chunks from an asyncio queue that the scheduler thread fills. A streaming client that goes away
cancels its request (Starlette cancels the response's generator), which frees its cache row
before the next step; a non-streaming one is polled for a disconnect while it waits. A request
that fails while it generates ends alone: a 500 with a one-line message, or for a stream an
error event and the end of the stream (serving/admission.py says what a client is told).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.core.sampling import SamplingParams, TokenLogprob
from specdec.decoder import GenerationResult, StreamChunk
from specdec.grammar import TokenMatcher
from specdec.serving.admission import ConstraintCompiler, ended_by
from specdec.serving.connections import DEFAULT_READ_TIMEOUT
from specdec.serving.metrics import ServerMetrics
from specdec.serving.protocol import (
    FINISH_REASONS,
    ApiError,
    ChatRequest,
    CompletionRequest,
    ResponseKind,
    acceptance_summary,
    completion_object,
    logprobs_object,
    new_id,
    speculation_summary,
    usage,
)
from specdec.serving.scheduler import QueueFullError, Scheduler, Ticket
from specdec.text import chat_prompt_ids, encode_prompt, fewest_tokens, most_bytes_a_token, with_prediction_ids


@dataclass
class ServerLimits:
    max_tokens: int = 2048  # the most new tokens one request may ask for
    default_chat_tokens: int = 512  # when a chat request names no max_tokens
    disconnect_poll_seconds: float = 0.5
    api_key: str | None = None  # every /v1 route then needs "Authorization: Bearer <key>"
    # The largest request body read (413 past it, before it is parsed); None: 32 bytes per token of
    # the context, at least 1 MiB: a prompt the context cannot hold is refused before it is tokenized.
    max_body_bytes: int | None = None
    # A schema, regex or grammar is compiled off the serving loop; over this many bytes, or past this
    # many seconds, it gets a 400 (a 1.3 MB grammar took 32 s to compile, then panicked the engine).
    max_grammar_bytes: int = 256 * 1024
    grammar_seconds: float = 20.0
    # Seconds a client has to send a request's headers, and then its body (serving/connections.py,
    # RequestBody): a slow or stalled client holds a connection no longer than that.
    read_timeout: float = DEFAULT_READ_TIMEOUT


class RequestBody:
    """ASGI middleware: a request's body read whole before the app runs, within ``timeout``
    seconds of its headers (else a 408 and the connection closed: a client sending its body slowly
    holds no more than that) and at most ``limit`` bytes (else a 413, at once from its
    Content-Length, else as soon as it passes the limit). (Raising from the app's own body read
    would not do: FastAPI turns any error there into a 400 "error parsing the body".)"""

    def __init__(self, app: Any, limit: int, timeout: float) -> None:
        self.app, self.limit, self.timeout = app, limit, timeout

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", ())).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await error_response(too_large(self.limit))(scope, receive, send)
        try:
            held = await asyncio.wait_for(self._read(receive), self.timeout)
        except asyncio.TimeoutError:
            response = error_response(ApiError(408, f"the request body did not arrive within this server's read "
                                                    f"timeout of {self.timeout:g} s", code="request_timeout"))
            response.headers["connection"] = "close"
            return await response(scope, receive, send)
        if held is None:
            return await error_response(too_large(self.limit))(scope, receive, send)

        async def replay() -> dict:
            return held.pop(0) if held else await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Any) -> list[dict] | None:
        """The body's messages, or None past the limit (at most ``limit`` bytes are held)."""
        held, size = [], 0
        while True:
            message = await receive()
            held.append(message)
            size += len(message.get("body", b""))
            if size > self.limit:
                return None
            if message["type"] != "http.request" or not message.get("more_body"):
                return held


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is over this server's limit of {limit} bytes", code="body_too_large")


class Session:
    """One request's chunks, from the scheduler thread into this event loop."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[StreamChunk | BaseException] = asyncio.Queue()
        self.scheduler = scheduler
        self.ticket: Ticket | None = None  # set once submitted (open_sessions)

    def emit(self, item: StreamChunk | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass

    async def chunks(self, http: Request | None = None, poll: float = 0.5) -> AsyncIterator[StreamChunk]:
        """The request's chunks up to its result; cancels the request if the consumer stops
        early or (when ``http`` is given) the client disconnects."""
        checked = time.monotonic()
        try:
            while True:
                # A client that left is noticed within ``poll`` seconds, also while tokens keep coming.
                if http is not None and time.monotonic() - checked >= poll:
                    checked = time.monotonic()
                    if await http.is_disconnected():
                        return
                try:
                    item = await asyncio.wait_for(self.queue.get(), poll) if http else await self.queue.get()
                except asyncio.TimeoutError:
                    continue
                if isinstance(item, BaseException):  # the error that ended this request (Scheduler.fail)
                    raise ended_by(item)
                yield item
                if item.result is not None:
                    return
        finally:
            if self.ticket is not None:
                self.scheduler.cancel(self.ticket)


def predicted_ids(sampling: SamplingParams) -> tuple[int, ...]:
    """The request's prediction in token ids (with_prediction_ids encoded a text one), or ()."""
    return sampling.prediction if isinstance(sampling.prediction, tuple) else ()


def prediction_counts(results: list[GenerationResult], prediction: Sequence[int]) -> tuple[int, int]:
    """OpenAI's (accepted_prediction_tokens, rejected_prediction_tokens) over the choices: the
    prediction's tokens that appear in each choice's completion, matched in order (difflib's
    matching blocks: an edit's inserted tokens match nothing, its deleted ones count as rejected),
    and the rest of the prediction. (What the drafter proposed from it and the target refused is
    specdec's own measure: the specdec:prediction_tokens metric.)"""
    from difflib import SequenceMatcher

    accepted = sum(block.size for result in results for block in
                   SequenceMatcher(None, list(prediction), result.token_ids, autojunk=False).get_matching_blocks())
    return accepted, len(prediction) * len(results) - accepted


def sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def add_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI-style error object: ours, request validation, and HTTP errors."""

    @app.exception_handler(ApiError)
    async def api_error(_: Request, error: ApiError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        if first.get("type") == "json_invalid":  # its loc holds a character offset, not a parameter
            offset = next((part for part in first.get("loc", ()) if isinstance(part, int)), None)
            reason = first.get("ctx", {}).get("error", "not valid JSON")
            at = "" if offset is None else f" at character {offset}"
            return error_response(ApiError(400, f"the request body is not valid JSON{at}: {reason}"))
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body") or None
        return error_response(ApiError(400, f"invalid request body: {first.get('msg', error)}", where))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(ApiError(error.status_code, str(error.detail)))


def open_sessions(scheduler: Scheduler, prompt_ids: list[int], sampling: SamplingParams, n: int,
                  matchers: list[TokenMatcher | None] | None = None) -> list[Session]:
    """One session per choice, submitted together: the first prefills the prompt and the others
    fork its cache row. With a seed s, choice i samples with seed s + i (unrelated streams: rules.py).
    ``matchers``: each choice's compiled constraint (ConstraintCompiler)."""
    sessions = [Session(scheduler) for _ in range(n)]
    samplings = [dataclasses.replace(sampling, seed=None if sampling.seed is None else sampling.seed + index)
                 for index in range(n)]
    try:
        tickets = scheduler.submit_choices(prompt_ids, samplings, [session.emit for session in sessions], matchers)
    except QueueFullError as error:
        raise ApiError(429, str(error), code="queue_full", kind="server_overloaded") from error
    except ValueError as error:
        raise ApiError(400, str(error), "prompt") from error
    for session, ticket in zip(sessions, tickets, strict=True):
        session.ticket = ticket
    return sessions


async def merged(sessions: list[Session]) -> AsyncIterator[tuple[int, StreamChunk]]:
    """Every session's chunks as they come, each with its choice index; stopping early cancels all."""
    queue: asyncio.Queue[tuple[int, StreamChunk | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, session: Session) -> None:
        try:
            async for chunk in session.chunks():
                await queue.put((index, chunk))
        except ApiError as error:
            await queue.put((index, error))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(index, session)) for index, session in enumerate(sessions)]
    try:
        remaining = len(sessions)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def respond(sessions: list[Session], kind: ResponseKind, body: Any, model_name: str, http: Request,
                  disconnect_poll_seconds: float, tokenizer: Any, prediction: Sequence[int] = ()) -> Any:
    """A completion's response, one choice per session: one object when the body does not stream,
    else server-sent events. ``prediction``: the request's predicted output in token ids."""
    def logprobs(entries: list[TokenLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
        return None if entries is None else logprobs_object(kind, entries, tokenizer, offset)

    request_id, created = new_id("cmpl" if kind == "completion" else "chatcmpl"), int(time.time())
    if not body.stream:
        async def result_of(session: Session) -> GenerationResult | None:
            result: GenerationResult | None = None
            async for chunk in session.chunks(http, disconnect_poll_seconds):
                result = chunk.result or result
            return result

        try:
            results = await asyncio.gather(*(result_of(session) for session in sessions))
        except ApiError:  # one choice failed: the others stop too
            for session in sessions:
                if session.ticket is not None:
                    session.scheduler.cancel(session.ticket)
            raise
        if any(result is None for result in results):  # the client went away
            return Response(status_code=499)
        done = [result for result in results if result is not None]
        choices = [completion_object(kind, request_id, model_name, result.text,
                                     FINISH_REASONS.get(result.finish_reason), created, index=index,
                                     logprobs=logprobs(result.logprobs))["choices"][0]
                   for index, result in enumerate(done)]
        response = completion_object(kind, request_id, model_name, "", None, created)
        response["choices"] = choices
        response["usage"] = usage(len(done[0].prompt_ids), sum(len(result.token_ids) for result in done),
                                  prediction_counts(done, prediction))
        response["specdec"] = speculation_summary(done)
        return response

    async def events() -> AsyncIterator[str]:
        started: set[int] = set()
        results: list[GenerationResult] = []
        offsets = [0] * len(sessions)  # text so far per choice, in the tokens' own pieces (text_offset)
        try:
            async for index, chunk in merged(sessions):
                finish = FINISH_REASONS.get(chunk.result.finish_reason) if chunk.result else None
                if chunk.text or finish or index not in started or chunk.logprobs:
                    chunk_logprobs = logprobs(chunk.logprobs, offsets[index])
                    if chunk_logprobs is not None and kind == "completion" and chunk.logprobs:
                        offsets[index] = chunk_logprobs["text_offset"][-1] + len(chunk_logprobs["tokens"][-1])
                    event = completion_object(kind, request_id, model_name, chunk.text, finish, created, chunk=True,
                                              first=index not in started, index=index, logprobs=chunk_logprobs)
                    if chunk.result is not None and chunk.result.stats.acceptance != "exact":
                        event["specdec"] = acceptance_summary([chunk.result])  # a LOSSY choice says so as it ends
                    yield sse(event)
                    started.add(index)
                if chunk.result:
                    results.append(chunk.result)
        except ApiError as error:  # the request failed while it streamed (vLLM's way: an error event, then the end)
            yield sse(error.body())
            yield sse("[DONE]")
            return
        if body.stream_options and body.stream_options.include_usage and results:
            final = completion_object(kind, request_id, model_name, "", None, created, chunk=True)
            final["choices"] = []
            final["usage"] = usage(len(results[0].prompt_ids), sum(len(result.token_ids) for result in results),
                                   prediction_counts(results, prediction))
            yield sse(final)
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")


def create_app(scheduler: Scheduler, model_name: str, limits: ServerLimits | None = None,
               metrics: ServerMetrics | None = None, default_acceptance: str = "exact") -> FastAPI:
    """The FastAPI app serving ``scheduler``'s engine as ``model_name``; the app's lifespan
    starts and stops the scheduler thread. ``default_acceptance``: for requests that name none
    (anything but "exact" is LOSSY: docs/acceptance.md)."""
    limits = limits or ServerLimits()
    tokenizer = scheduler.engine.target.tokenizer
    max_context = scheduler.engine.max_context  # --max-model-len: what a request may hold

    grammars = ConstraintCompiler(scheduler.engine.target, limits.max_grammar_bytes, limits.grammar_seconds)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        scheduler.start()
        yield
        scheduler.stop()
        grammars.close()

    # No /docs, /redoc or /openapi.json: they answer without the key and describe the server to
    # anyone (docs/serving.md documents the API).
    app = FastAPI(title="specdec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler = scheduler  # for tests and embedding programs
    app.state.max_body_bytes = limits.max_body_bytes or max(1 << 20, 32 * max_context)
    add_error_handlers(app)
    app.state.read_timeout = limits.read_timeout
    app.add_middleware(RequestBody, limit=app.state.max_body_bytes, timeout=limits.read_timeout)
    if limits.api_key:
        expected = f"Bearer {limits.api_key}".encode()

        @app.middleware("http")
        async def require_key(request: Request, call_next: Any) -> Response:
            # /health and /metrics stay open (load balancers and Prometheus scrape them)
            given = request.headers.get("authorization", "").encode()
            if request.url.path.startswith("/v1") and not hmac.compare_digest(given, expected):
                return error_response(ApiError(401, "this server needs an API key: Authorization: Bearer <key>",
                                               code="invalid_api_key", kind="authentication_error"))
            return await call_next(request)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {model_name!r}", "model",
                           code="model_not_found")

    most_bytes = most_bytes_a_token(tokenizer)

    def refuse_past_context(texts: list[str], param: str) -> None:
        """A 400 for a prompt whose text alone must hold more tokens than the context, before
        tokenizing it (the engine's check_prompt counts the tokens of the rest)."""
        if most_bytes is None:
            return
        fewest = sum(fewest_tokens(text, most_bytes) for text in texts)
        if fewest >= max_context:
            size = sum(len(text.encode()) for text in texts)
            raise ApiError(400, f"prompt has at least {fewest} tokens ({size} bytes of text) but the context holds "
                                f"{max_context}: no room to generate; shorten the prompt", param)

    async def admit(body: CompletionRequest | ChatRequest, sampling: SamplingParams, prompt_ids: list[int],
                    param: str) -> list[Session]:
        """Every check before the request joins the batch, its constraint compiled last (off the loop)."""
        try:
            scheduler.engine.check_prompt(prompt_ids)
        except ValueError as error:
            raise ApiError(400, str(error), param) from error
        asked = body.asked_constraint()
        matchers = await grammars.matchers(sampling.constraint, asked[0] if asked else None, body.n)
        return open_sessions(scheduler, prompt_ids, sampling, body.n, matchers)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        check_model(body.model)
        sampling = body.sampling(body.max_tokens, 16, limits.max_tokens, default_acceptance)
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            refuse_past_context([prompt], "prompt")
        try:
            prompt_ids = encode_prompt(tokenizer, prompt, model_name)
        except ValueError as error:
            raise ApiError(400, str(error), "prompt") from error
        sampling = with_prediction_ids(sampling, tokenizer, model_name)  # (the engine reads token ids)
        sessions = await admit(body, sampling, prompt_ids, "prompt")
        return await respond(sessions, "completion", body, model_name, http, limits.disconnect_poll_seconds,
                             tokenizer, predicted_ids(sampling))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, http: Request):
        check_model(body.model)
        sampling = body.sampling(body.requested_max_tokens, limits.default_chat_tokens, limits.max_tokens,
                                 default_acceptance)
        messages = [m.as_text(index) for index, m in enumerate(body.messages)]
        refuse_past_context([message["content"] for message in messages], "messages")
        try:
            prompt_ids = chat_prompt_ids(tokenizer, messages)
        except ValueError as error:
            raise ApiError(400, str(error), "messages") from error
        sampling = with_prediction_ids(sampling, tokenizer, model_name)  # (the engine reads token ids)
        sessions = await admit(body, sampling, prompt_ids, "messages")
        return await respond(sessions, "chat", body, model_name, http, limits.disconnect_poll_seconds, tokenizer,
                             predicted_ids(sampling))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                             "owned_by": "specdec", "max_model_len": max_context}]}

    replica = secrets.token_hex(4)  # tells replicas apart behind a balancer; unlike a pid, says nothing of the host

    @app.get("/health")
    async def health() -> dict[str, Any]:
        running, waiting = scheduler.load
        return {"status": "ok", "running": running, "waiting": waiting,
                "draft_length": scheduler.controller.last_choice, "replica": replica}

    @app.get("/metrics")
    async def metrics_route() -> Response:
        body = metrics.exposition() if metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return app
