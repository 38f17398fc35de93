"""A bad request fails alone. Refused schemas, regexes and grammars get a 400 with a one-line message
before the request joins the batch, compiled off the serving loop within a size and a time limit;
an error raised for one request while it generates (its grammar matcher, its drafter, its text)
ends that request only (a 500, or an error event in its stream), while concurrent innocent
streams complete with exactly the text each gets alone, and the next request is served."""

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import specdec.serving.scheduler as scheduler_module
from specdec import load
from specdec.constraint import ConstraintError
from specdec.defaults import default_model
from specdec.drafting.ngram import NGramDrafter
from specdec.grammar import GrammarCompiler, TokenMatcher
from specdec.serving.app import ServerLimits
from specdec.serving.in_thread import serve_in_thread
from specdec.serving.server import build_app
from specdec.text import encode_prompt

MODEL = "toy"
INNOCENT = ["def f(x):", "import os\n", "class Stack:"]
TOKENS = 48
VICTIM = "# this request fails\n"
SECRET = "SECRET-ENGINE-STATE"  # in the injected errors' text: it must never reach a client


@pytest.fixture(scope="module")
def target():
    # float64: a request's text does not depend on its batch, so batched text equals alone text
    return load(default_model("target"), dtype="float64")


def serve(target, drafter=None, **limits):
    app = build_app(target, drafter or NGramDrafter(), MODEL, speculation="on", max_batch=8,
                    limits=ServerLimits(max_tokens=64, **limits))
    return app.state.scheduler, serve_in_thread(app)


def body(prompt: str, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, **extra}


def events(url: str, payload: dict | str) -> list[str]:
    """The data of every server-sent event of a streamed completion."""
    content = payload if isinstance(payload, str) else json.dumps({**payload, "stream": True})
    with httpx.stream("POST", f"{url}/v1/completions", content=content, timeout=120,
                      headers={"content-type": "application/json"}) as response:
        assert response.status_code == 200, response.read()
        return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def stream_text(url: str, prompt: str) -> str:
    data = events(url, body(prompt))
    assert data[-1] == "[DONE]" and not any("error" in json.loads(item) for item in data[:-1]), data
    return "".join(json.loads(item)["choices"][0]["text"] for item in data[:-1])


def complete(url: str, content: str | dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", content=content if isinstance(content, str) else json.dumps(content),
                      headers={"content-type": "application/json"}, timeout=120)


@pytest.fixture(scope="module")
def alone(target) -> list[str]:
    """Each innocent prompt's text, streamed alone."""
    _, running = serve(target)
    with running as url:
        return [stream_text(url, prompt) for prompt in INNOCENT]


def beside_innocents(scheduler, url: str, bad: Callable[[], object]) -> tuple[object, list[str]]:
    """``bad()``'s result, called once the innocent streams are all decoding, and their texts."""
    with ThreadPoolExecutor(len(INNOCENT)) as pool:
        streams = [pool.submit(stream_text, url, prompt) for prompt in INNOCENT]
        deadline = time.monotonic() + 60
        while len(scheduler.running) < len(INNOCENT) and time.monotonic() < deadline and not any(
                stream.done() for stream in streams):
            time.sleep(0.005)
        result = bad()
        return result, [stream.result() for stream in streams]


def settled(scheduler) -> bool:
    """Whether every row is free again, soon (a reply can arrive just before its row is released)."""
    deadline = time.monotonic() + 10
    while scheduler.load != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    return scheduler.load == (0, 0)


def assert_one_line(error: dict) -> None:
    message = error["message"]
    assert "\n" not in message and SECRET not in message and "<state>" not in message
    assert "panic" not in message.lower() and "backtrace" not in message.lower() and len(message) < 400


def nested_schema(levels: int) -> str:
    """A JSON schema nested ``levels`` deep, as text (json.dumps would overflow Python's stack)."""
    return '{"type": "object", "properties": {"a": ' * (levels // 2) + '{"type": "string"}' + "}}" * (levels // 2)


def raw_body(field: str, json_text: str) -> str:
    return '{"model": "toy", "prompt": "x", "max_tokens": 4, "temperature": 0, "%s": %s}' % (field, json_text)


REFUSED = {  # what the grammar engine refuses, or a limit does, before the request joins the batch
    "regex_lexer_limit": json.dumps(body("x", guided_regex="a{1000000}")),
    "regex_nested_repeats": json.dumps(body("x", guided_regex="((a{100}){100}){100}")),
    # its first token a free choice, so the forced-token walk stops before the repetition: the bound
    # on repetitions refuses it (it failed mid-generation before)
    "regex_repeat_after_a_choice": json.dumps(body("x", guided_regex="(b|c)a{1000000}")),
    "regex_syntax": json.dumps(body("x", guided_regex="(")),
    "schema_5000_levels": raw_body("guided_json", nested_schema(5000)),
    "schema_5000_levels_as_text": raw_body("guided_json", json.dumps(nested_schema(5000))),
    "schema_200_levels": raw_body("guided_json", nested_schema(200)),
    "response_format_200_levels": raw_body("response_format", '{"type": "json_schema", "json_schema": {"schema": '
                                           + nested_schema(200) + "}}"),
    "grammar_1_3_mb": json.dumps(body("x", guided_grammar="start: " + " | ".join(
        f'"w{index:08d}"' for index in range(100_000)))),
    "grammar_syntax": json.dumps(body("x", guided_grammar="start: (")),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_refused_constraint_gets_a_400_and_harms_no_one(target, alone, case):
    scheduler, running = serve(target, max_body_bytes=4 << 20)  # the 1.3 MB grammar gets past the body limit
    with running as url:
        response, texts = beside_innocents(scheduler, url, lambda: complete(url, REFUSED[case]))
        assert response.status_code == 400, response.text  # type: ignore[attr-defined]
        assert_one_line(response.json()["error"])  # type: ignore[attr-defined]
        assert texts == alone
        assert stream_text(url, INNOCENT[0]) == alone[0]  # the next request is served as before
        assert complete(url, body(INNOCENT[1])).json()["choices"][0]["text"] == alone[1]
        assert settled(scheduler)


# A schema's pattern and a grammar's repetitions, bounded at admission as a regex is (issue 79: they
# passed admission and failed once tokens flowed: a 400 grammar_failed, or an error event after 200).
REPEATS_PAST_THE_BOUND = {
    "schema_pattern": body("x", response_format={"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "string", "pattern": "^(b|c)a{1000000}$"}}}),
    "grammar_regex_literal": body("x", guided_grammar="start: /(b|c)a{1000000}/"),
    "grammar_lark_repeat": body("x", guided_grammar='start: ("b" | "c") "a"~1000000'),
    "grammar_gbnf_repeat": body("x", guided_grammar='root ::= ("b" | "c") "a"{1000000}'),
}


@pytest.mark.parametrize("case", sorted(REPEATS_PAST_THE_BOUND))
def test_a_huge_repetition_in_a_schema_or_grammar_is_refused_at_admission(target, case):
    """A 400 saying the bound (grammar_too_complex), streamed or not: never a stream that starts
    and then fails. Mutation, checked: bounding regexes only (as before) lets all four through
    admission (grammar_failed once tokens flow)."""
    scheduler, running = serve(target)
    with running as url:
        for stream in (False, True):
            response = httpx.post(f"{url}/v1/completions", json={**REPEATS_PAST_THE_BOUND[case], "stream": stream},
                                  timeout=120)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["code"] == "grammar_too_complex" and "1000000" in error["message"], error
            assert_one_line(error)
        assert settled(scheduler)


def slow_compiles(monkeypatch, seconds: float) -> list[str]:
    """Every grammar compile first sleeps ``seconds``; returns the names of the threads that compiled."""
    threads, matcher = [], GrammarCompiler.matcher

    def slow(self, constraint, *args):
        threads.append(threading.current_thread().name)
        time.sleep(seconds)
        return matcher(self, constraint, *args)

    monkeypatch.setattr(GrammarCompiler, "matcher", slow)
    return threads


def test_compiling_a_grammar_does_not_stall_the_other_streams(target, alone, monkeypatch):
    """A grammar that takes 6 s to compile: the innocent streams, started beside it, all end before it
    is compiled (on the scheduler thread they waited for it, as a 1.3 MB grammar made every stream
    wait 15 s, and the 8-token constrained request then ended first), and it then completes."""
    threads = slow_compiles(monkeypatch, 6.0)
    scheduler, running = serve(target)
    with running as url:
        with ThreadPoolExecutor(1) as pool:
            constrained = pool.submit(complete, url, body("x", guided_regex="[a-z]{1,8}", max_tokens=8))
            while not threads:
                time.sleep(0.005)
            _, texts = beside_innocents(scheduler, url, lambda: None)
            assert not constrained.done()
            reply = constrained.result()
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"].isalpha()
    assert texts == alone and threads and all(name.startswith("specdec-grammar") for name in threads)


def test_a_grammar_past_the_time_limit_gets_a_400(target, alone, monkeypatch):
    slow_compiles(monkeypatch, 2.0)
    scheduler, running = serve(target, grammar_seconds=0.3)
    with running as url:
        response = complete(url, body("x", guided_regex="[a-z]+"))
        assert response.status_code == 400 and response.json()["error"]["code"] == "grammar_too_complex"
        assert_one_line(response.json()["error"])
        assert stream_text(url, INNOCENT[0]) == alone[0]


class Panic(BaseException):
    """As pyo3's PanicException (a Rust panic in a binding such as llguidance): not an Exception."""


def test_a_grammar_engine_panic_while_compiling_gets_a_400(target, alone, monkeypatch):
    def panics(self, constraint, *args):
        raise Panic(f"assertion failed: grammar.symbols.len() < u16::MAX\n<backtrace> {SECRET}")

    monkeypatch.setattr(GrammarCompiler, "matcher", panics)
    scheduler, running = serve(target)
    with running as url:
        response, texts = beside_innocents(scheduler, url, lambda: complete(url, body("x", guided_grammar="start: x")))
        assert response.status_code == 400, response.text  # type: ignore[attr-defined]
        assert_one_line(response.json()["error"])  # type: ignore[attr-defined]
        assert texts == alone and stream_text(url, INNOCENT[0]) == alone[0]


class FailingDrafter(NGramDrafter):
    """An n-gram drafter that raises for the victim's request (``where``: "start", as the request is
    admitted; "propose", in a batched call as a head drafts; "observe", after the target's forward)."""

    def __init__(self, victim: list[int], where: str, seen: list[int], scheduler_of: Callable) -> None:
        super().__init__()
        self.victim, self.where, self.seen, self.scheduler_of = victim, where, seen, scheduler_of

    def fail_for(self, requests) -> None:
        if any(list(request.prompt_ids) == self.victim for request in requests):
            self.seen.append(len(self.scheduler_of().running))
            raise RuntimeError(f"drafter broke: {SECRET}")

    def start(self, prompt_ids):
        if self.where == "start" and prompt_ids.tolist() == self.victim:
            self.seen.append(len(self.scheduler_of().running))
            raise RuntimeError(f"drafter broke: {SECRET}")
        return super().start(prompt_ids)

    def propose_many(self, requests, gammas):
        if self.where == "propose":
            self.fail_for(requests)
        return [self.propose(request, gamma) for request, gamma in zip(requests, gammas, strict=True)]

    def observe(self, request, outcome) -> None:
        if self.where == "observe":
            self.fail_for([request])
        super().observe(request, outcome)


def inject(kind: str, target, monkeypatch, seen: list[int], scheduler_of: Callable):
    """(drafter, extra body fields of the victim) for a failure of ``kind`` while the victim generates."""
    victim = encode_prompt(target.tokenizer, VICTIM, MODEL)
    if kind.startswith("drafter_"):
        return FailingDrafter(victim, kind.split("_")[1], seen, scheduler_of), {}
    if kind == "detokenizer":
        step_chunk = scheduler_module.step_chunk

        def failing_chunk(request, *args):
            if list(request.prompt_ids) == victim:
                seen.append(len(scheduler_of().running))
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, SECRET)
            return step_chunk(request, *args)

        monkeypatch.setattr(scheduler_module, "step_chunk", failing_chunk)
        return None, {}
    # The grammar matcher: only the victim is constrained, so every matcher is the victim's. Before
    # the forward (its masks) with a panic, or after it (consuming the emitted tokens), with an
    # internal error or the grammar engine's refusal of the client's grammar (its lexer's limit).
    method, error = {"matcher_masks": ("masks_along", Panic(SECRET)),
                     "matcher_consume": ("consume", RuntimeError(SECRET)),
                     "matcher_refuses": ("consume", ConstraintError("the lexer's size limit was reached"))}[kind]

    def failing(self, *args):
        seen.append(len(scheduler_of().running))
        raise error

    monkeypatch.setattr(TokenMatcher, method, failing)
    return None, {"guided_regex": "[a-z ]{1,40}"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", ["matcher_masks", "matcher_consume", "matcher_refuses", "drafter_start",
                                  "drafter_propose", "drafter_observe", "detokenizer"])
def test_an_error_while_generating_ends_that_request_only(target, alone, monkeypatch, kind, stream):
    """A 500 (or an error event) for an internal error, a 400 (invalid_request_error) where the
    grammar engine stopped on the client's grammar: its input, not the server, is at fault."""
    status, code = (400, "grammar_failed") if kind == "matcher_refuses" else (500, "generation_failed")
    seen: list[int] = []
    holder: list = []
    drafter, extra = inject(kind, target, monkeypatch, seen, lambda: holder[0])
    scheduler, running = serve(target, drafter)
    holder.append(scheduler)
    with running as url:
        victim = body(VICTIM, **extra)
        if stream:
            data, texts = beside_innocents(scheduler, url, lambda: events(url, victim))
            assert data[-1] == "[DONE]" and "error" in json.loads(data[-2]), data  # type: ignore[index]
            error = json.loads(data[-2])["error"]  # type: ignore[index]
        else:
            response, texts = beside_innocents(scheduler, url, lambda: complete(url, victim))
            assert response.status_code == status, response.text  # type: ignore[attr-defined]
            error = response.json()["error"]  # type: ignore[attr-defined]
        assert error["code"] == code
        assert error["type"] == ("invalid_request_error" if status == 400 else "server_error")
        assert_one_line(error)
        assert texts == alone
        assert seen and max(seen) > 1  # it failed inside a batch it shared with innocent streams
        assert stream_text(url, INNOCENT[2]) == alone[2]  # then the next request is served
        assert settled(scheduler)


def test_a_slow_client_is_cut_after_the_read_timeout_while_others_are_served(target):
    """One client sends half its body and stalls, another dribbles its headers: after the read
    timeout the first gets a 408 and both connections are closed; a request sent meanwhile is
    answered at once. Mutation, checked: without the deadlines both stay open past the timeout."""
    import socket
    import urllib.parse

    _, server = serve(target, read_timeout=1.0)
    with server as url:
        address = urllib.parse.urlsplit(url)
        slow_body, slow_headers = (socket.create_connection((address.hostname, address.port)) for _ in range(2))
        started = time.monotonic()
        payload = json.dumps(body("def f(x):")).encode()
        slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n" % len(payload) + payload[:10])
        slow_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        answered = httpx.post(f"{url}/v1/completions", json=body("import os\n"), timeout=60)
        assert answered.status_code == 200 and time.monotonic() - started < 30

        def read_until_closed(connection: socket.socket) -> bytes:
            connection.settimeout(10)
            received = b""
            while chunk := connection.recv(65536):
                received += chunk
            return received

        refused = read_until_closed(slow_body)
        assert refused.startswith(b"HTTP/1.1 408") and b"request_timeout" in refused, refused
        assert read_until_closed(slow_headers) == b""
        assert time.monotonic() - started < 10
        slow_body.close()
        slow_headers.close()
