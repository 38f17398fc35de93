"""The server's KV-cache memory: one pool of blocks sized up front (serving/memory.py) that every
request draws on, the longest request it allows refused beyond with a 400 before prefill, blocks
given back when requests end, and requests preempted (their text unchanged) when the pool runs
dry."""

import threading

import httpx
import pytest
import torch
from test_prefill_pieces import one_loop
from test_scheduling import collect

from specdec import SamplingParams, SpeculativeDecoder, load, make_drafter
from specdec.assembly import engine_of
from specdec.models.paged_cache import BLOCK_SIZE
from specdec.serving.in_thread import serve_in_thread
from specdec.serving.memory import DEFAULT_SHARE, kv_budget, parse_size, plan_kv_budget
from specdec.serving.scheduler import PrefillBudget, Scheduler
from specdec.serving.server import build_app
from specdec.serving.speculation import SpeculationController

GIB = 2**30


def test_sizes_parse():
    assert parse_size("8GiB") == 8 * GIB and parse_size("6G") == 6 * 10**9 and parse_size("512 MB") == 512 * 10**6
    assert parse_size("1000") == 1000 and parse_size("1.5kib") == 1536
    with pytest.raises(ValueError, match="not a memory size"):
        parse_size("lots")


def test_the_budget_sets_the_pool_and_the_longest_request_and_the_options_must_agree():
    per_token, rows, context = 46080, 40, 8192
    default = plan_kv_budget(per_token, rows, context, available=22 * GIB)
    assert default.budget_bytes == int(22 * GIB * DEFAULT_SHARE)
    assert default.pool_tokens == default.budget_bytes // per_token // BLOCK_SIZE * BLOCK_SIZE
    assert default.max_model_len == context  # one request may use the whole context: the pool holds it
    roomy = plan_kv_budget(per_token, rows, context, available=10**13)  # never more than every row's whole context
    assert roomy.pool_tokens == rows * context and roomy.budget_bytes == rows * context * per_token
    small = plan_kv_budget(per_token, rows, context, kv_cache_memory=100 * 2**20)
    assert small.pool_tokens == 2272 and small.max_model_len == 2272  # the pool, when smaller than the context
    by_length = plan_kv_budget(per_token, rows, context, max_model_len=1000, available=22 * GIB)
    assert by_length.max_model_len == 1000 and by_length.pool_tokens == default.pool_tokens
    with pytest.raises(ValueError, match="--max-model-len 8000 .* over the KV cache's"):
        plan_kv_budget(per_token, rows, context, kv_cache_memory=GIB // 4, max_model_len=8000)
    with pytest.raises(ValueError, match="raise --kv-cache-memory"):
        plan_kv_budget(per_token, rows, context, kv_cache_memory=1000)
    with pytest.raises(ValueError, match="must be 2..8192"):
        plan_kv_budget(per_token, rows, context, max_model_len=8193)
    assert f"a pool of {default.pool_tokens // BLOCK_SIZE:,} blocks of {BLOCK_SIZE} tokens" in default.describe(32)


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


def scheduler_with_pool(tiny_pair, pool_tokens, max_batch=4, prefix_rows=2, quantize="int4"):
    target = load(tiny_pair["target"], quantize=quantize)
    drafter = make_drafter("model", load(tiny_pair["perturbed"], dtype="float64"))
    engine = engine_of(target, drafter, gamma=3, prefill_chunk=8)
    scheduler = Scheduler(engine, SpeculationController("on", 3), max_batch=max_batch, prefix_rows=prefix_rows,
                          prefill=PrefillBudget(tokens=8), pool_tokens=pool_tokens)
    return scheduler, SpeculativeDecoder(target, drafter, gamma=3, prefill_chunk=8)


def test_a_long_request_uses_the_pool_short_ones_leave_and_gives_its_blocks_back(tiny_pair):
    """A request of nearly the whole context beside a short one, in a pool that could not hold
    every row at that length: both run, the long one's blocks come back when it ends, and each
    got what it gets alone."""
    scheduler, alone = scheduler_with_pool(tiny_pair, pool_tokens=256)
    pool = scheduler.cache
    long_prompt = [(5 * i + 1) % 96 for i in range(scheduler.engine.max_context - 40)]
    free = []
    scheduler.submit([1, 2, 3], SamplingParams(max_new_tokens=60), lambda item: free.append(pool.free_block_count))
    first = run(scheduler, [long_prompt], [SamplingParams(max_new_tokens=30)])
    assert min(free) <= pool.num_blocks - pool.blocks_for(len(long_prompt))  # it held the long prompt's blocks
    while scheduler.running or scheduler.prefilling:
        one_loop(scheduler)
    stored = sum(pool.blocks_for(len(entry.tokens)) for entry in scheduler.prefixes.entries)
    assert pool.free_block_count == pool.num_blocks - stored  # every request's blocks back; stored prompts hold theirs
    assert first[0] == alone.generate(long_prompt, SamplingParams(max_new_tokens=30)).token_ids


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_requests_preempted_when_the_pool_runs_dry_get_the_text_they_get_alone(tiny_pair, temperature):
    """Six requests whose contexts do not fit together in a pool of 7 blocks (8 ran dry only while
    prompts' blocks could be taken back: PagedKVCache.hold): the youngest are preempted or, still
    prefilling, deferred (blocks freed), admitted again later, their contexts computed again, and every
    request's tokens are what it gets alone (greedy and seeded). Mutation checked: resuming
    without feeding the generated tokens again (Engine.refill stopping at the prompt) fails it."""
    scheduler, alone = scheduler_with_pool(tiny_pair, pool_tokens=7 * BLOCK_SIZE, max_batch=6, prefix_rows=0)
    # Every request runs its 50 tokens, whatever it samples: no early end token leaves the pool room.
    scheduler.engine.target.eos_token_ids = ()
    prompts = [[(7 * i + 3 * k) % 90 + 3 for i in range(20 + 9 * k)] for k in range(6)]
    samplings = [SamplingParams(max_new_tokens=50, temperature=temperature, seed=k) for k in range(6)]
    preempted = []  # running requests preempted, or prefilling ones deferred (the youngest goes, either way)
    for verb in ("preempt", "defer"):
        original = getattr(scheduler, verb)
        setattr(scheduler, verb, lambda ticket, original=original: (preempted.append(ticket.id), original(ticket)))
    results = run(scheduler, prompts, samplings)
    assert preempted  # the pool ran dry: some request was taken out and came back
    assert scheduler.cache.free_block_count == scheduler.cache.num_blocks
    for index, (prompt, sampling) in enumerate(zip(prompts, samplings, strict=True)):
        assert results[index] == alone.generate(prompt, sampling).token_ids, index


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


def test_a_prompt_text_past_the_context_is_refused_before_it_is_tokenized(tiny_pair, monkeypatch):
    """A text whose bytes alone need more tokens than the context (at most the tokenizer's longest
    spelling a token, times what normalization can shrink) is refused without encoding it,
    completions and chat alike; a text the bound lets through but whose tokens do not fit is
    refused by its count, as before."""
    from specdec.text import NORMALIZED_BYTES

    target = load(tiny_pair["target"], dtype="float64")
    app = build_app(target, None, "tiny", speculation="off", max_batch=2, max_model_len=32)
    encoded: list[int] = []
    encode = target.tokenizer.encode
    monkeypatch.setattr(target.tokenizer, "encode",
                        lambda text, *a, **k: encoded.append(len(text)) or encode(text, *a, **k))
    longest = max(len(token.encode()) for token in target.tokenizer.get_vocab())
    too_long = "a" * (32 * longest * NORMALIZED_BYTES)
    with serve_in_thread(app) as url:
        for route, body in [("completions", {"prompt": too_long}),
                            ("chat/completions", {"messages": [{"role": "user", "content": too_long}]})]:
            refused = httpx.post(f"{url}/v1/{route}", json={**body, "max_tokens": 4})
            assert refused.status_code == 400, refused.text
            assert "at least 32 tokens" in refused.json()["error"]["message"]
        assert encoded == []
        counted = httpx.post(f"{url}/v1/completions", json={"prompt": too_long[:40], "max_tokens": 4})
        assert counted.status_code == 400 and "prompt has 40 tokens" in counted.json()["error"]["message"]
        assert encoded == [40]


def test_kv_budget_of_a_model_sizes_its_pool(tiny_pair):
    target = load(tiny_pair["target"], dtype="float32")
    budget = kv_budget(target, max_batch=4, prefix_cache_rows=2, kv_cache_memory="1MiB")
    cache = target.new_cache(rows=1)
    assert budget.bytes_per_token == cache.bytes_per_token
    assert budget.pool_tokens == 2**20 // cache.bytes_per_token // BLOCK_SIZE * BLOCK_SIZE
    assert budget.max_model_len == min(target.max_context, budget.pool_tokens)


def test_a_prompt_up_to_the_context_is_accepted_where_the_pool_holds_it_and_one_more_refused(tiny_pair):
    """In a pool of one context (the default of a model with a small context), the longest prompt
    that leaves room for a token is answered; one token more gets a 400 with the numbers."""
    target = load(tiny_pair["target"], quantize="int4")
    context = target.max_context
    app = build_app(target, None, "tiny", speculation="off", max_batch=2,
                    budget=plan_kv_budget(target.new_cache().bytes_per_token, 2, context, max_model_len=context,
                                          kv_cache_memory=context * target.new_cache().bytes_per_token))
    with serve_in_thread(app) as url:
        answer = httpx.post(f"{url}/v1/completions", json={"prompt": [5] * (context - 1), "max_tokens": 4,
                                                            "temperature": 0})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 1
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": [5] * context, "max_tokens": 4})
        assert refused.status_code == 400 and f"{context} tokens but the context holds {context}" in \
            refused.json()["error"]["message"]


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


def test_stored_prompts_and_n_choices_share_blocks_instead_of_copying_them(tiny_pair):
    """Blocks counted while requests run: a prompt taken from the prefix cache, and OpenAI's n
    choices of one prompt, hold the shared blocks once (each row copies only the partly filled
    block it writes into), and every output is what it is alone. Mutation checked: fork copying
    its blocks (as the contiguous cache did) fails both counts."""
    scheduler, alone = scheduler_with_pool(tiny_pair, pool_tokens=64 * BLOCK_SIZE, prefix_rows=2)
    pool = scheduler.cache
    prompt = [(3 * i) % 90 + 3 for i in range(90)]
    settings = SamplingParams(max_new_tokens=8)
    first = run(scheduler, [prompt], [settings])
    stored = pool.num_blocks - pool.free_block_count
    assert stored == pool.blocks_for(88)  # its whole prefill pieces of 8, kept by reference
    in_use = []
    scheduler.submit(prompt, settings, lambda item: in_use.append(pool.num_blocks - pool.free_block_count))
    while scheduler.waiting or scheduler.prefilling or scheduler.running:
        one_loop(scheduler)
    # The stored blocks, the copy of the partly filled one it writes into, and a block of its own
    # past them (a copy of the stored prompt would hold all of its blocks again).
    assert max(in_use) == stored + 2

    scheduler, _ = scheduler_with_pool(tiny_pair, pool_tokens=64 * BLOCK_SIZE, prefix_rows=0)
    pool, in_use, results = scheduler.cache, [], {}
    short = prompt[:60]  # 59 tokens prefilled: blocks 0 (full) and 1 (partly)

    def emit(index):
        def record(item):
            in_use.append(pool.num_blocks - pool.free_block_count)
            if not isinstance(item, BaseException) and item.result is not None:
                results[index] = item.result.token_ids
        return record

    scheduler.submit_choices(short, [SamplingParams(max_new_tokens=3, temperature=1.0, seed=seed)
                                     for seed in (1, 2, 3)], [emit(index) for index in range(3)])
    while scheduler.waiting or scheduler.prefilling or scheduler.running:
        one_loop(scheduler)
    assert max(in_use) == 4  # block 0 once, block 1 three times (two writers copy it); copies: 6
    assert first[0] == alone.generate(prompt, settings).token_ids
    assert [results[i] for i in range(3)] == [
        alone.generate(short, SamplingParams(max_new_tokens=3, temperature=1.0, seed=seed)).token_ids
        for seed in (1, 2, 3)]
