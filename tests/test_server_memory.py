"""The server's KV-cache memory: a budget chosen up front (serving/memory.py), the longest request
it allows refused beyond with a 400 before prefill, and a cache that shrinks back when the long
requests end (it never stays grown to the longest request seen); outputs unchanged."""

import threading

import httpx
import pytest
import torch
from test_prefill_pieces import one_loop
from test_scheduling import collect

from specdec import SamplingParams, SpeculativeDecoder, load, make_drafter
from specdec.engine import Engine
from specdec.serving.memory import DEFAULT_SHARE, parse_size, plan_kv_budget
from specdec.serving.scheduler import PrefillBudget, Scheduler
from specdec.serving.server import build_app, kv_budget, serve_in_thread
from specdec.serving.speculation import SpeculationController

GIB = 2**30


def test_sizes_parse():
    assert parse_size("8GiB") == 8 * GIB and parse_size("6G") == 6 * 10**9 and parse_size("512 MB") == 512 * 10**6
    assert parse_size("1000") == 1000 and parse_size("1.5kib") == 1536
    with pytest.raises(ValueError, match="not a memory size"):
        parse_size("lots")


def test_the_budget_sets_the_longest_request_and_the_options_must_agree():
    per_token, rows, context = 46080, 40, 8192
    default = plan_kv_budget(per_token, rows, context, available=22 * GIB)
    assert default.budget_bytes == int(22 * GIB * DEFAULT_SHARE)
    assert default.max_model_len == default.budget_bytes // (rows * per_token) < context
    assert rows * default.max_model_len * per_token <= default.budget_bytes
    roomy = plan_kv_budget(per_token, rows, context, available=10**13)  # never more than the context needs
    assert roomy.max_model_len == context and roomy.budget_bytes == rows * context * per_token
    given = plan_kv_budget(per_token, rows, context, kv_cache_memory=4 * GIB)
    assert given.max_model_len == 4 * GIB // (rows * per_token)
    by_length = plan_kv_budget(per_token, rows, context, max_model_len=1000, available=22 * GIB)
    assert by_length.budget_bytes == rows * 1000 * per_token
    with pytest.raises(ValueError, match="--max-model-len 8000 .* over --kv-cache-memory"):
        plan_kv_budget(per_token, rows, context, kv_cache_memory=GIB, max_model_len=8000)
    with pytest.raises(ValueError, match="is available"):
        plan_kv_budget(per_token, rows, context, max_model_len=8000, available=GIB)
    with pytest.raises(ValueError, match="raise --kv-cache-memory"):
        plan_kv_budget(per_token, rows, context, kv_cache_memory=1000)
    assert "40 rows (32 requests + 8 prefix-cache)" in default.describe(32)


def test_a_cache_gives_back_what_it_shrinks_and_keeps_the_committed_slots(tiny_pair):
    target = load(tiny_pair["target"], dtype="float64")
    cache = target.new_cache(rows=2)
    target.extend(torch.arange(1, 40), cache, row=1)
    kept = cache.keys[:, 1, :, :39].clone()
    cache.reserve(cache.max_length)
    grown = cache.nbytes
    cache.shrink(48)
    assert cache.capacity == 48 and cache.nbytes * cache.max_length == grown * 48
    assert torch.equal(cache.keys[:, 1, :, :39], kept)
    cache.shrink(8)  # never below a committed length
    assert cache.capacity == 39
    assert cache.bytes_per_token * cache.capacity * cache.rows == cache.nbytes


def run(scheduler, prompts, samplings):
    """Submit, then drive the scheduler's loops here until every request is done (deterministic:
    what the scheduler holds is read between loops, never during one)."""
    results, done = {}, threading.Event()
    done.expected = len(prompts)
    for index, (prompt, sampling) in enumerate(zip(prompts, samplings, strict=True)):
        collect(scheduler, prompt, sampling, results, done, index)
    while scheduler.waiting or scheduler.prefilling or scheduler.running:
        one_loop(scheduler)
    return results


def test_the_cache_shrinks_when_the_long_request_ends_and_outputs_stay_exact(tiny_pair):
    """A long request grows every row; once it ends and only short ones run, the cache is back
    to what they need (a stored prefix of the long prompt goes with it), and every request got
    what it gets alone."""
    target = load(tiny_pair["target"], dtype="float64")
    drafter = make_drafter("model", load(tiny_pair["perturbed"], dtype="float64"))
    engine = Engine(target, drafter, gamma=3, prefill_chunk=8)
    scheduler = Scheduler(engine, SpeculationController("on", 3), max_batch=4, prefix_rows=2,
                          prefill=PrefillBudget(tokens=8), smallest_cache=16)
    alone = SpeculativeDecoder(target, drafter, gamma=3, prefill_chunk=8)
    long_prompt = [(5 * i + 1) % target.vocab_size for i in range(target.max_context - 40)]
    sizes = []
    scheduler.submit([1, 2, 3], SamplingParams(max_new_tokens=60), lambda item: sizes.append(
        (scheduler.cache.capacity, len(scheduler.prefixes.entries))))
    first = run(scheduler, [long_prompt], [SamplingParams(max_new_tokens=30)])
    grown = max(capacity for capacity, _ in sizes)
    assert grown >= len(long_prompt) + 30 and any(entries for _, entries in sizes)
    # The short request outlived the long one: the cache shrank to its need while it ran.
    assert sizes[-1] == (3 + 60, 0)
    second = run(scheduler, [[6, 7, 8], [9, 10]], [SamplingParams(max_new_tokens=20)] * 2)
    assert scheduler.cache.capacity <= 2 * (3 + 20)  # grown geometrically again, within twice its need
    assert first[0] == alone.generate(long_prompt, SamplingParams(max_new_tokens=30)).token_ids
    assert second[0] == alone.generate([6, 7, 8], SamplingParams(max_new_tokens=20)).token_ids


def test_a_prompt_past_max_model_len_gets_a_400_naming_it_and_output_stops_there(tiny_pair):
    target = load(tiny_pair["target"], dtype="float64")
    app = build_app(target, None, "tiny", speculation="off", max_batch=2, max_model_len=32)
    with serve_in_thread(app) as url:
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": list(range(1, 33)), "max_tokens": 4})
        assert refused.status_code == 400 and "--max-model-len" in refused.json()["error"]["message"]
        answer = httpx.post(f"{url}/v1/completions", json={"prompt": list(range(1, 21)), "max_tokens": 100,
                                                            "temperature": 0}).json()
        assert answer["usage"]["completion_tokens"] == 12 and answer["choices"][0]["finish_reason"] == "length"
        models = httpx.get(f"{url}/v1/models").json()
        assert models["data"][0]["max_model_len"] == 32
    assert app.state.scheduler.cache.max_length == 32


def test_kv_budget_of_a_model_counts_every_row(tiny_pair):
    target = load(tiny_pair["target"], dtype="float32")
    budget = kv_budget(target, max_batch=4, prefix_cache_rows=2, kv_cache_memory="1MiB")
    cache = target.new_cache(rows=1)
    assert budget.bytes_per_token == cache.bytes_per_token and budget.rows == 6
    assert budget.max_model_len == min(target.max_context, 2**20 // (6 * cache.bytes_per_token))


@pytest.mark.parametrize("committed", [0, 5])
def test_a_long_chain_attends_in_blocks_and_scores_as_in_one_call(tiny_pair, monkeypatch, committed):
    """A prompt fed in one forward attends in blocks of QUERY_BLOCK queries (memory linear in its
    length): the logits and the cache entries are those of one call over every query (float64)."""
    import specdec.models.attention as attention

    target = load(tiny_pair["target"], dtype="float64")
    tokens = torch.tensor([(3 * i + 1) % target.vocab_size for i in range(70)])
    results = []
    for block in (10**6, 16):  # one call; blocks of 16 queries (5 blocks)
        monkeypatch.setattr(attention, "QUERY_BLOCK", block)
        cache = target.new_cache()
        if committed:
            target.extend(tokens[:committed], cache)
        # not batch-invariant: after a committed context, a batch-invariant float model attends per query
        results.append((target.extend(tokens[committed:], cache, batch_invariant=False),
                        cache.keys[..., :70, :].clone()))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=1e-12)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=1e-12)
