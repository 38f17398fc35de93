"""The OpenAI-compatible server, through the official `openai` client on 127.0.0.1: outputs equal
generate(), 100 concurrent streams, cancelled streams free their rows, bad requests get a 4xx
with an OpenAI-style body and the server keeps serving, /metrics counts what happened."""

import asyncio
import gc
import json
import time
import weakref

import httpx
import openai
import pytest

from specdec import SpeculativeDecoder, load, make_drafter
from specdec.defaults import default_model, default_prompts
from specdec.serving.app import ServerLimits
from specdec.serving.in_thread import serve_in_thread
from specdec.serving.server import build_app
from specdec.text import chat_prompt_ids

MODEL = "toy-pair"
MAX_BATCH = 8


@pytest.fixture(scope="module")
def pair():
    # float64: outputs are identical whatever the batch composition, so the server's batched
    # greedy output can be compared token for token with one request decoded alone.
    return load(default_model("target"), dtype="float64"), load(default_model("draft"), dtype="float64")


@pytest.fixture(scope="module")
def server(pair):
    target, draft = pair
    app = build_app(target, make_drafter("model", draft), MODEL, gamma=4, speculation="auto", max_batch=MAX_BATCH,
                    max_waiting=200, limits=ServerLimits(max_tokens=256, disconnect_poll_seconds=0.1))
    with serve_in_thread(app) as url:
        yield url, app.state.scheduler


@pytest.fixture(scope="module")
def reference(pair):
    decoder = SpeculativeDecoder(pair[0])  # the target alone: what lossless output must equal
    return lambda prompt, tokens: decoder.generate(prompt, max_new_tokens=tokens).text


def client(url: str, cls=openai.OpenAI):
    return cls(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def suite_prompts(count: int) -> list[str]:
    prompts = [item["prompt"] for item in json.loads(default_prompts().read_text())]
    return [prompts[i % len(prompts)] for i in range(count)]


@pytest.mark.slow
def test_completions_equal_generate_streaming_or_not(server, reference):
    url, _ = server
    api = client(url)
    for prompt in suite_prompts(3):
        whole = api.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        streamed = "".join(chunk.choices[0].text
                           for chunk in api.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                                               temperature=0, stream=True))
        assert whole.choices[0].text == streamed == reference(prompt, 24)
        assert whole.usage.completion_tokens == 24 and whole.choices[0].finish_reason == "length"
        assert whole.model_extra["specdec"]["target_forwards"] >= 1


def test_chat_equals_generate_on_the_templated_prompt(server, pair, reference):
    url, _ = server
    api = client(url)
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    expected = reference(chat_prompt_ids(pair[0].tokenizer, messages), 20)
    whole = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected
    chunks = list(api.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 20


def test_a_shared_system_prompt_is_prefilled_once(server, pair, reference):
    """Two chats behind one long system prompt: the second copies its whole prefill pieces from the
    prefix cache (counted in /metrics) and answers what the target alone answers."""
    url, _ = server
    api = client(url)
    system = {"role": "system", "content": "You are a careful Python reviewer. " * 6}
    before = metric_values(url)
    for question in ("def add(a, b):", "def mul(a, b):"):
        messages = [system, {"role": "user", "content": question}]
        answer = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
        assert answer.choices[0].message.content == reference(chat_prompt_ids(pair[0].tokenizer, messages), 8)
    after = metric_values(url)
    assert after["specdec:prefix_cache_hits_total"] - before.get("specdec:prefix_cache_hits_total", 0) >= 1
    assert after["specdec:prompt_tokens_cached_total"] - before.get("specdec:prompt_tokens_cached_total", 0) >= 32


@pytest.mark.slow
def test_a_hundred_concurrent_streams_all_complete_with_the_right_text(server, reference):
    url, scheduler = server
    prompts = suite_prompts(100)
    lengths = [6 + (index * 7) % 19 for index in range(100)]  # requests finish at different steps
    api = client(url, openai.AsyncOpenAI)

    async def one(prompt: str, tokens: int) -> str:
        stream = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=tokens, temperature=0,
                                              stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def everything():
        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths, strict=True)))

    texts = asyncio.run(everything())
    assert texts == [reference(p, n) for p, n in zip(prompts, lengths, strict=True)]
    assert scheduler.load == (0, 0)


def test_the_server_builds_no_policy_beside_its_controller(server):
    """The controller chooses every step's lengths: the engine builds no per-request policy."""
    _, scheduler = server
    assert scheduler.engine.new_policy() is None


def test_a_seed_gives_one_completion_alone_or_in_a_batch(server, pair):
    """temperature 0.9 with a seed (the coupled rule by default): the same text on every call,
    alone, again, and among 12 concurrent requests with other seeds (whose batch changes the
    controller's draft lengths), and it is the target alone's seeded text."""
    url, _ = server
    prompt = "def fibonacci(n):"
    settings = dict(model=MODEL, prompt=prompt, max_tokens=20, temperature=0.9, seed=1234)
    api = client(url)
    first = api.completions.create(**settings).choices[0].text
    assert api.completions.create(**settings).choices[0].text == first
    target_alone = SpeculativeDecoder(pair[0]).generate(prompt, temperature=0.9, seed=1234, max_new_tokens=20)
    assert first == target_alone.text
    async_api = client(url, openai.AsyncOpenAI)

    async def batch():
        others = [async_api.completions.create(**{**settings, "seed": seed, "prompt": p})
                  for seed, p in enumerate(suite_prompts(11))]
        return await asyncio.gather(async_api.completions.create(**settings), *others)

    texts = [completion.choices[0].text for completion in asyncio.run(batch())]
    assert texts[0] == first
    assert len(set(texts[1:])) > 1  # the others really sampled their own texts
    rejection = api.completions.create(**settings, extra_body={"sampling_rule": "rejection"})
    assert rejection.usage.completion_tokens == 20
    with pytest.raises(openai.BadRequestError, match="sampling_rule"):
        api.completions.create(**settings, extra_body={"sampling_rule": "nearest"})


def test_n_choices_share_one_prefill_and_sample_as_separate_requests(server, pair):
    """n = 4 with seed s: choices 0-3, choice i the target alone's text with seed s + i, streamed
    or not, from one prefill (three rows forked: /metrics counts their prompt tokens as forked).
    Greedy n = 3 (three requests of one prompt and one setting): three equal texts."""
    url, _ = server
    prompt = "def fibonacci(n):"
    settings = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0.9, seed=77, n=4)
    api = client(url)
    forked_before = metric_values(url).get("specdec:prompt_tokens_forked_total", 0.0)
    response = api.completions.create(**settings)
    alone = SpeculativeDecoder(pair[0])
    expected = [alone.generate(prompt, temperature=0.9, seed=77 + i, max_new_tokens=12).text for i in range(4)]
    assert [choice.index for choice in response.choices] == [0, 1, 2, 3]
    assert [choice.text for choice in response.choices] == expected
    assert len(set(expected)) > 1
    prompt_tokens = len(pair[0].tokenizer(prompt)["input_ids"])
    assert response.usage.prompt_tokens == prompt_tokens and response.usage.completion_tokens == 48
    assert metric_values(url)["specdec:prompt_tokens_forked_total"] - forked_before == 3 * (prompt_tokens - 1)
    streamed = [""] * 4
    for chunk in api.completions.create(**settings, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == expected
    greedy = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8,
                                         temperature=0, n=3)
    assert len(greedy.choices) == 3 and len({choice.message.content for choice in greedy.choices}) == 1


def test_logprobs_are_the_targets_own_streamed_or_not(server, pair):
    """Completions' logprobs (top 2) and chat's (top 3): one entry per generated token, the values
    the target alone reports (SpeculativeDecoder(target) with logprobs), the same streamed."""
    url, _ = server
    api = client(url)
    prompt = "def add(a, b):"
    response = api.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=2)
    alone = SpeculativeDecoder(pair[0]).generate(prompt, max_new_tokens=10, logprobs=2)
    logprobs = response.choices[0].logprobs
    assert logprobs.token_logprobs == [entry.logprob for entry in alone.logprobs]
    assert len(logprobs.tokens) == len(logprobs.top_logprobs) == response.usage.completion_tokens
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == response.choices[0].text
    streamed = []
    for chunk in api.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=2,
                                        stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.token_logprobs
    assert streamed == logprobs.token_logprobs
    messages = [{"role": "user", "content": "Write a haiku"}]
    chat = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(item.top_logprobs) == 3 for item in content)
    assert all(item.top_logprobs[0].logprob >= item.logprob for item in content)
    chat_ids = chat_prompt_ids(pair[0].tokenizer, messages)
    alone_chat = SpeculativeDecoder(pair[0]).generate(chat_ids, max_new_tokens=8, logprobs=3)
    assert [item.logprob for item in content] == [entry.logprob for entry in alone_chat.logprobs]
    plain = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None


def wait_until_idle(scheduler, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while scheduler.load != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)


def test_cancelled_streams_free_their_rows_and_state(server):
    url, scheduler = server
    api = client(url)
    streams = [api.completions.create(model=MODEL, prompt=p, max_tokens=256, temperature=0.8, stream=True)
               for p in suite_prompts(4)]
    for stream in streams:
        next(iter(stream))  # the request is running
    requests = [weakref.ref(ticket.request) for ticket in list(scheduler.running) if ticket.request is not None]
    states = [weakref.ref(ticket.request.draft_state) for ticket in list(scheduler.running) if ticket.request]
    assert requests  # (a sampled request may already have ended at an EOS)
    for stream in streams:
        stream.close()
    wait_until_idle(scheduler)
    assert scheduler.load == (0, 0)
    assert sorted(scheduler.free_rows) == list(range(MAX_BATCH))
    assert scheduler.cache.lengths[:MAX_BATCH] == [0] * MAX_BATCH  # (the rows past them hold the prefix cache)
    gc.collect()
    assert all(ref() is None for ref in requests + states)  # draft caches included


BAD_REQUESTS = [
    ("malformed JSON", "/v1/completions", b'{"model": "toy-pair", "prompt": ', 400),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404),
    ("negative max_tokens", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -3}, 400),
    ("max_tokens over the limit", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 100000}, 400),
    ("temperature out of range", "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 7}, 400),
    ("top_p out of range", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400),
    ("prompt longer than the context", "/v1/completions", {"model": MODEL, "prompt": [5] * 5000}, 400),
    ("logprobs over 5", "/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 6}, 400),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400),
    ("frequency_penalty (not supported)", "/v1/completions",
     {"model": MODEL, "prompt": "x", "frequency_penalty": 0.5}, 400),
    ("logit_bias (not supported)", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 10}}, 400),
    ("echo (not supported)", "/v1/completions", {"model": MODEL, "prompt": "x", "echo": True}, 400),
    ("n over the limit", "/v1/completions", {"model": MODEL, "prompt": "x", "n": 17}, 400),
    ("n of 0", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 0}, 400),
    ("no messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
    ("unknown role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("no such route", "/v1/engines", {"model": MODEL}, 404),
    ("a regex the grammar engine refuses", "/v1/completions",
     {"model": MODEL, "prompt": "x", "guided_regex": "("}, 400),
    ("a schema with an unknown type", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "wizard"}}}}, 400),
    ("two constraints at once", "/v1/completions",
     {"model": MODEL, "prompt": "x", "guided_regex": "a+", "response_format": {"type": "json_object"}}, 400),
]


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[case[0] for case in BAD_REQUESTS])
def test_bad_requests_get_a_4xx_and_the_server_keeps_serving(server, reference, case):
    url, _ = server
    _, path, body, status = case
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if case[0] == "malformed JSON":  # the position in words, not a character offset as the "param"
        assert error["param"] is None and "not valid JSON at character 32" in error["message"], error
    good = client(url).completions.create(model=MODEL, prompt="def f(x):", max_tokens=8, temperature=0)
    assert good.choices[0].text == reference("def f(x):", 8)


def test_structured_output_through_the_openai_client(server, pair):
    """response_format json_schema, json_object and guided_regex: valid output, the same text as
    the target alone under the same constraint (greedy), forced tokens counted."""
    from specdec import Constraint, SamplingParams

    jsonschema = pytest.importorskip("jsonschema")
    url, _ = server
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "size"],
              "properties": {"name": {"type": "string", "maxLength": 12}, "size": {"enum": ["s", "m", "l"]}}}
    api = client(url)
    chat = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A shirt as JSON"}], max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "shirt", "schema": schema}})
    jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
    prompt = "def f(x):"
    alone = SpeculativeDecoder(pair[0])
    pattern = "[a-z]{3,8}( = [0-9]+)?;"
    for extra, constraint in (({"response_format": {"type": "json_object"}}, Constraint.json_object()),
                              ({"guided_regex": pattern}, Constraint.regex(pattern))):
        served = api.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, extra_body=extra)
        expected = alone.generate(prompt, SamplingParams(max_new_tokens=40, constraint=constraint)).text
        assert served.choices[0].text == expected
    assert metric_values(url)["specdec:forced_tokens_total"] > 0


def metric_values(url: str) -> dict[str, float]:
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in httpx.get(f"{url}/metrics").text.splitlines()
            if line and not line.startswith("#")}


@pytest.mark.parametrize("cache_tokens", [20_000, 0])
def test_the_suffix_cache_is_shared_by_requests_and_reported(pair, reference, cache_tokens):
    """One deployment's requests share its suffix cache: a second client's identical request copies
    the first one's answer (counted in /metrics), with the same text; a cap of 0 turns it off."""
    app = build_app(pair[0], make_drafter("suffix", suffix_cache_tokens=cache_tokens), MODEL, gamma=6,
                    speculation="on")
    with serve_in_thread(app) as url:
        texts = [client(url).completions.create(model=MODEL, prompt="def parse(line):", max_tokens=40,
                                                temperature=0).choices[0].text for _ in range(2)]
        values = metric_values(url)
    assert texts[0] == texts[1] == reference("def parse(line):", 40)
    assert values["specdec:suffix_cache_max_tokens"] == cache_tokens
    assert (values["specdec:suffix_cache_tokens"] > 0) == (cache_tokens > 0)
    assert (values["specdec:spec_decode_num_accepted_tokens_from_cache_total"] > 20) == (cache_tokens > 0)


def test_models_health_and_metrics(server):
    url, _ = server
    assert [m.id for m in client(url).models.list().data] == [MODEL]
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    client(url).completions.create(model=MODEL, prompt="class Stack:", max_tokens=16, temperature=0)
    values = metric_values(url)
    assert values["specdec:spec_decode_num_draft_tokens_total"] > 0
    per_position = "specdec:spec_decode_num_accepted_tokens_per_pos_total"
    assert values["specdec:spec_decode_num_accepted_tokens_total"] == sum(
        value for name, value in values.items() if name.startswith(per_position))
    assert values["specdec:time_to_first_token_seconds_count"] >= 1
    assert values["specdec:num_requests_running"] == 0


def test_auto_serves_the_target_alone_text_and_counts_its_choices(pair, reference):
    """The auto drafter behind the server: each request's text is the target's alone, and /metrics
    counts the steps of each candidate it chose (and those it left undrafted)."""
    target, draft = pair
    app = build_app(target, make_drafter("auto", draft, target=target), MODEL, gamma=8, speculation="on",
                    max_batch=4)
    prompts = suite_prompts(4)
    with serve_in_thread(app) as url:
        texts = [client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                                temperature=0).choices[0].text for prompt in prompts]
        values = metric_values(url)
    assert texts == [reference(prompt, 24) for prompt in prompts]
    steps = {name.split('"')[1]: value for name, value in values.items()
             if name.startswith("specdec:drafter_steps_total")}
    assert set(steps) <= {"suffix", "ngram", "ngram-edit", "model", "none"} and sum(steps.values()) > 0, steps
    accepted = sum(value for name, value in values.items() if name.startswith("specdec:drafter_accepted_tokens_total"))
    assert accepted == values["specdec:spec_decode_num_accepted_tokens_total"]
