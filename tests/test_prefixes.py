"""The server's prefix cache: a prompt that begins like a recent one copies the shared whole
prefill pieces from a spare cache row and computes only the rest, with the outputs (and a head's
drafts) it gets when it prefills alone; the rows are bounded and the least recently used goes."""

import threading

import torch
from table_lm import table_model

from specdec import SamplingParams, SpeculativeDecoder, load, make_drafter
from specdec.assembly import engine_of
from specdec.serving.prefixes import PrefixCache
from specdec.serving.scheduler import Scheduler
from specdec.serving.speculation import SpeculationController

SYSTEM = [(i * 5 + 2) % 96 for i in range(13)]  # a shared system prompt: three 4-token pieces and one token


def run_in_turn(scheduler: Scheduler, prompts, samplings) -> list[list[int]]:
    """Each request after the previous one ended (so the first is stored before the next comes)."""
    outputs = []
    for prompt, sampling in zip(prompts, samplings, strict=True):
        finished, result = threading.Event(), []

        def emit(item, result=result, finished=finished):  # this request's, bound now
            if isinstance(item, BaseException) or item.result is not None:
                result.append(item if isinstance(item, BaseException) else item.result)
                finished.set()

        scheduler.submit(prompt, sampling, emit)
        assert finished.wait(60)
        assert not isinstance(result[0], BaseException), result[0]
        outputs.append(result[0])
    return outputs


def test_a_shared_prefix_is_computed_once_and_the_outputs_do_not_change(tiny_pair):
    """Three prompts behind one 13-token system prompt (float32 target, a head drafter, pieces of
    4): the second and third copy 12 tokens (three whole pieces) and give the texts, seeded
    samples and head drafts they give alone. Mutation, checked: reusing all 13 shared tokens (a
    piece cut short) fails the count of reused tokens; the tiny target's texts do not show it
    (its last bits happened not to change a token here)."""
    from specdec.drafting.head_format import new_head

    target = load(tiny_pair["target"])
    torch.manual_seed(1)
    drafter = make_drafter("head", target=target, head=new_head(target))
    engine = engine_of(target, drafter, gamma=3, prefill_chunk=4)
    prompts = [SYSTEM + tail for tail in ([7, 8, 9], [10, 11], [12, 13, 14, 15, 16])]
    samplings = [SamplingParams(max_new_tokens=10), SamplingParams(temperature=1.0, seed=3, max_new_tokens=10),
                 SamplingParams(max_new_tokens=10)]
    scheduler = Scheduler(engine, SpeculationController("on", 3), max_batch=2, prefix_rows=2).start()
    try:
        served = run_in_turn(scheduler, prompts, samplings)
    finally:
        scheduler.stop()
    assert scheduler.prefixes.hits == 2 and scheduler.prefixes.tokens_reused == 24
    alone = SpeculativeDecoder(target, drafter, gamma=3, prefill_chunk=4)
    for result, prompt, sampling in zip(served, prompts, samplings, strict=True):
        expected = alone.generate(prompt, sampling)
        assert result.token_ids == expected.token_ids
        assert (result.stats.drafted, result.stats.accepted) == (expected.stats.drafted, expected.stats.accepted)


def test_the_prefix_cache_keeps_whole_pieces_in_bounded_rows():
    target = table_model(6, seed=1, max_context=64)
    cache = target.new_cache(rows=3)
    engine = engine_of(target, prefill_chunk=4)
    prefixes = PrefixCache(cache, [1, 2], chunk=4)

    def prefilled(prompt):
        request = engine.new_request(prompt, SamplingParams(max_new_tokens=2), row=0)
        cache.rollback(0, 0)
        engine.prefill([request], cache, on_prefilled=prefixes.store)
        return request

    prefilled([1, 2, 3, 4, 5, 1, 2, 3, 4, 5])  # 9 prompt tokens fed: 8 kept (two pieces)
    assert [entry.tokens for entry in prefixes.entries] == [[1, 2, 3, 4, 5, 1, 2, 3]]
    prefilled([1, 2, 3, 4, 5, 1, 2, 3, 0, 0, 0, 0, 5, 5])  # extends it: takes its row
    assert [len(entry.tokens) for entry in prefixes.entries] == [12]
    prefilled([2, 2, 2, 2, 2, 2])  # 5 fed: one piece
    prefilled([3, 3, 3, 3, 3, 3])  # no row free: the least recently used goes
    assert [entry.tokens[0] for entry in prefixes.entries] == [2, 3]
    request = engine.new_request([3, 3, 3, 3, 3, 3, 3, 3, 3], SamplingParams(max_new_tokens=2), row=0)
    assert prefixes.reuse(request) == 4 and request.fed == 4  # whole pieces of the shared 6
    assert cache.tokens[0, :4].tolist() == [3, 3, 3, 3]
    short = engine.new_request([2, 2, 2], SamplingParams(max_new_tokens=2), row=0)
    assert prefixes.reuse(short) == 0  # under one piece left to share
    assert prefixes.queries == 2 and prefixes.hits == 1
