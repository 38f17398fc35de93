"""Random malformed bodies (hypothesis) thrown at a running server: random JSON values, wrong types
for every field of the completions and chat bodies, huge numbers, odd Unicode, bytes that are not
JSON. Every answer is a 4xx, or a 200 where a body happens to be a valid request (a stream then
holds no error event), never a 5xx; the server stays alive, and an innocent stream running all
along gets, each time, exactly its text alone."""

import contextlib
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec import load
from specdec.defaults import default_model
from specdec.drafting.ngram import NGramDrafter
from specdec.serving.app import ServerLimits
from specdec.serving.in_thread import serve_in_thread
from specdec.serving.server import build_app

MODEL = "toy"
INNOCENT = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 16, "temperature": 0, "stream": True}

COMPLETION_FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                     "sampling_rule", "stop", "stream", "stream_options", "n", "response_format", "guided_json",
                     "guided_regex", "guided_grammar", "presence_penalty", "frequency_penalty", "logit_bias",
                     "best_of", "echo", "suffix", "tools", "logprobs"]
CHAT_FIELDS = [*(name for name in COMPLETION_FIELDS if name not in ("prompt", "logprobs", "echo", "suffix")),
               "messages", "max_completion_tokens", "logprobs", "top_logprobs"]

ODD_TEXT = ["", " " * 64, "\ud800", "a\udfffb", "\x00", "<|im_end|>\n<|im_start|>system", "\u202e\u200b", "🙂" * 8,
            "%s%n{0}", "a{1000000}", "((a{100}){100}){100}", "[", "start: (", '{"type": "object"}', "null", "NaN"]
texts = st.text(max_size=24) | st.sampled_from(ODD_TEXT)
numbers = (st.integers(min_value=-(2**70), max_value=2**70) | st.sampled_from([2**63, -(2**63) - 1, 10**30, 0, -1])
           | st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([1e308, -0.0, 5e-324]))
json_values = st.recursive(st.none() | st.booleans() | numbers | texts,
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
                           max_leaves=10)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"]) | texts,
                                           "content": json_values | texts}), max_size=3) | json_values


def with_fields(base: dict, fields: list[str]) -> st.SearchStrategy[dict]:
    """``base`` with one to four of ``fields`` set to random JSON values (messages: random messages)."""
    value = {name: messages if name == "messages" else json_values for name in fields}
    return st.lists(st.sampled_from(fields), min_size=1, max_size=4, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({name: value[name] for name in names}).map(lambda got: {**base, **got}))


COMPLETION = {"model": MODEL, "prompt": "x", "max_tokens": 4, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
bodies = st.one_of(
    st.tuples(st.just("/v1/completions"), with_fields(COMPLETION, COMPLETION_FIELDS)),
    st.tuples(st.just("/v1/chat/completions"), with_fields(CHAT, CHAT_FIELDS)),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), json_values),
)


def encoded(body) -> bytes:
    """As JSON (NaN and Infinity as Python writes them, which its parser reads back)."""
    return json.dumps(body).encode()


@pytest.fixture(scope="module")
def server():
    target = load(default_model("target"), dtype="float64")  # batch-invariant text: alone == beside others
    app = build_app(target, NGramDrafter(), MODEL, speculation="on", max_batch=8,
                    limits=ServerLimits(max_tokens=16, max_body_bytes=1 << 16))
    with serve_in_thread(app) as url:
        yield url


def streamed_text(url: str, body: dict) -> str:
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        data = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return "".join(json.loads(item)["choices"][0]["text"] for item in data[:-1])


def check(url: str, path: str, content: bytes) -> None:
    response = httpx.post(f"{url}{path}", content=content, headers={"content-type": "application/json"}, timeout=120)
    assert response.status_code < 500, (content[:300], response.text[:300])
    if response.status_code != 200:
        assert 400 <= response.status_code < 500 and "error" in response.json(), response.text[:300]
        message = response.json()["error"]["message"]
        assert "\n" not in message and "Traceback" not in message and "panic" not in message.lower()
    elif response.headers["content-type"].startswith("text/event-stream"):  # a stream: no error event in it
        events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and not any("error" in json.loads(event) for event in events[:-1]), events


@contextlib.contextmanager
def innocent_stream(url: str):
    """An innocent stream, again and again while the block runs; each time its text must be its text
    alone (checked after), and the server must still answer after."""
    alone = streamed_text(url, INNOCENT)
    stop, texts = threading.Event(), []

    def innocent() -> None:
        while not stop.is_set():
            texts.append(streamed_text(url, INNOCENT))

    runner = threading.Thread(target=innocent)
    runner.start()
    try:
        yield
    finally:
        stop.set()
        runner.join(timeout=120)
    assert texts and all(text == alone for text in texts)
    assert httpx.get(f"{url}/health", timeout=30).json()["status"] == "ok"
    assert streamed_text(url, INNOCENT) == alone


# Each field set to each of these in turn (hypothesis's draws seldom reach every pair): every field of
# a completion, the fields only chat has on a chat body.
EDGE_VALUES = [None, True, -1, 2**63, 10**30, 1e308, float("nan"), float("inf"), "", "\ud800", [1, "a", None],
               {"a": {"b": [None]}}]


@pytest.mark.slow  # a sweep of malformed bodies; the fast tier keeps test_server's bad requests, test_server_guards
def test_every_field_at_every_edge_value_gets_a_4xx_or_a_clean_200(server):
    cases = [(path, encoded({**base, field: value})) for path, base, fields in (
        ("/v1/completions", COMPLETION, COMPLETION_FIELDS),
        ("/v1/chat/completions", CHAT, [name for name in CHAT_FIELDS if name not in COMPLETION_FIELDS]))
        for field in fields for value in EDGE_VALUES]
    with innocent_stream(server), ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda case: check(server, *case), cases))


@pytest.mark.slow  # a sweep of malformed bodies; the fast tier keeps test_server's bad requests, test_server_guards
def test_random_malformed_bodies_get_a_4xx_and_harm_no_one(server):
    @settings(max_examples=100, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(bodies)
    def json_bodies(case) -> None:
        path, body = case
        check(server, path, encoded(body))

    @settings(max_examples=20, deadline=None, database=None)
    @given(st.binary(max_size=64), st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    def byte_bodies(content: bytes, path: str) -> None:
        check(server, path, content)

    with innocent_stream(server):
        json_bodies()
        byte_bodies()
