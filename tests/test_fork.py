"""Forked cache rows (OpenAI's n from one prefill): a child row starts as a copy of its parent's
prompt, decodes as if it had prefilled itself, never writes into its parent's row, and n samples
from one prefill each follow the target's law."""

import dataclasses

import pytest
import torch
from law import assert_matches_law
from table_lm import table_model
from test_distribution import PROMPT, SAMPLING_CASES, exact_sequence_law, table_drafter

from specdec import SamplingParams, SpeculativeDecoder, load, make_drafter
from specdec.core.engine import Engine


def decode(engine: Engine, cache, requests, forks=()) -> None:
    """Prefill (parents fed, children forked) and step every request to its end."""
    done = engine.prefill(requests, cache, forks=forks)
    assert len(done) == len(requests) + len(forks)
    running = list(done)
    while running:
        engine.step(running, cache)
        running = [request for request in running if request.finish_reason is None]


@pytest.mark.parametrize("drafter_kind", ["model", "head"])
def test_forked_rows_decode_as_if_prefilled_alone_and_leave_the_parent_alone(tiny_pair, drafter_kind):
    """One prefill, three forks: greedy and seeded outputs equal those of four requests that each
    prefilled (prompt pieces of 4, so every row's prompt holds the same bits either way); the
    parent row's prompt entries are unchanged by its children's steps, bit for bit; a head drafter
    gets the prompt's features in every child. Mutations, checked: forking a row's length without
    copying its keys and values fails the output equality; a head child without the features fails
    the drafted counts."""
    from specdec.drafting.head_format import new_head

    target = load(tiny_pair["target"])
    torch.manual_seed(0)
    drafter = (make_drafter("model", load(tiny_pair["perturbed"]), target=target) if drafter_kind == "model"
               else make_drafter("head", target=target, head=new_head(target)))
    engine = SpeculativeDecoder(target, drafter, gamma=3, prefill_chunk=4).engine
    prompt = [(i * 7 + 3) % 96 for i in range(19)]
    samplings = [SamplingParams(max_new_tokens=12), *(SamplingParams(temperature=1.0, seed=seed, max_new_tokens=12)
                                                       for seed in (5, 6, 7))]

    alone_cache = target.new_cache(rows=4)
    alone = [engine.new_request(prompt, sampling, row) for row, sampling in enumerate(samplings)]
    decode(engine, alone_cache, alone)

    cache = target.new_cache(rows=4)
    parent = engine.new_request(prompt, samplings[0], 0)
    children = [engine.new_request(prompt, sampling, row) for row, sampling in enumerate(samplings[1:], start=1)]
    decode(engine, cache, [parent], [(parent, child) for child in children])
    prompt_slots = slice(0, len(prompt) - 1)
    for row in range(4):  # the parent's prompt entries as its own prefill wrote them; each child's a copy
        assert torch.equal(cache.keys[:, row, :, prompt_slots], alone_cache.keys[:, 0, :, prompt_slots])
        assert torch.equal(cache.values[:, row, :, prompt_slots], alone_cache.values[:, 0, :, prompt_slots])
    assert all(child.stats.prefill_seconds == 0 for child in children)  # no forward of their own
    assert [r.generated_ids for r in [parent, *children]] == [r.generated_ids for r in alone]
    assert len({tuple(r.generated_ids) for r in children}) > 1
    if drafter_kind == "head":  # the same features, so the same drafts (the head is batch-invariant)
        counts = [[(r.stats.drafted, r.stats.accepted) for r in group] for group in (children, alone[1:])]
        assert counts[0] == counts[1]


def test_a_cache_fork_copies_the_prefix_and_is_independent():
    target = table_model(6, seed=100)
    cache = target.new_cache(rows=2)
    target.extend(torch.tensor([1, 2, 3, 4]), cache, row=0)
    cache.fork(0, 1, 3)
    assert cache.lengths == [4, 3] and cache.tokens[1, :3].tolist() == [1, 2, 3]
    target.extend(torch.tensor([5, 5]), cache, row=1)
    assert cache.tokens[0, :4].tolist() == [1, 2, 3, 4]
    with pytest.raises(AssertionError):
        cache.fork(0, 0, 2)


@pytest.mark.slow
def test_n_samples_from_one_prefill_each_follow_the_law():
    """Chi-square per row: a prompt prefilled once and forked into 4 rows that sample together
    (n = 4), each row's 3-token continuation against the enumerated target law, with a draft model."""
    vocab, length, samples = 6, 3, 5000
    target = table_model(vocab, seed=100)
    engine = SpeculativeDecoder(target, table_drafter("model", vocab), gamma=2).engine
    sampling = SAMPLING_CASES["top-k"]
    law = exact_sequence_law(target, PROMPT, length, sampling)
    counts = [dict.fromkeys(law, 0) for _ in range(4)]
    cache = target.new_cache(rows=4)
    for seed in range(samples):
        requests = [engine.new_request(PROMPT, dataclasses.replace(sampling, seed=seed * 4 + row,
                                                                   max_new_tokens=length), row) for row in range(4)]
        decode(engine, cache, requests[:1], [(requests[0], child) for child in requests[1:]])
        for row, request in enumerate(requests):
            counts[row][tuple(request.generated_ids)] += 1
    for row, count in enumerate(counts):
        assert_matches_law(count, law, f"row {row}")
