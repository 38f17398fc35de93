"""Requests decoded together: a batch gives each request what it gets alone (greedy outputs,
seeded samples, the law of each row), and requests never share state (policies, streams)."""

import dataclasses
import random

import pytest
from law import assert_matches_law
from lockstep_drafts import drafts_after
from table_lm import table_model
from test_distribution import PROMPT, SAMPLING_CASES, exact_sequence_law, table_drafter

from specdec import SamplingParams, SpeculativeDecoder, load, make_drafter
from specdec.core.policy import POLICIES

DRAFT_KINDS = ("same", "independent", "perturbed")


def batch_prompts(seed: int, vocab_size: int, count: int = 8) -> list[list[int]]:
    """Prompts of different lengths, some repetitive (so n-gram lookup finds something)."""
    rng = random.Random(seed)
    prompts = []
    for index in range(count):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 14))]
        prompts.append(prompt * 2 if index % 2 else prompt)
    return prompts


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["specdec", "transformers"])
def test_batched_greedy_equals_single_request(tiny_pair, backend):
    target = load(tiny_pair["target"], dtype="float64", backend=backend)
    drafters = {kind: make_drafter("model", load(tiny_pair[kind], dtype="float64", backend=backend))
                for kind in DRAFT_KINDS}
    drafters["ngram"] = make_drafter("ngram")
    prompts = batch_prompts(0, target.vocab_size)
    plain = [SpeculativeDecoder(target).generate(p, max_new_tokens=20).token_ids for p in prompts]
    for name, drafter in drafters.items():
        decoder = SpeculativeDecoder(target, drafter, gamma=4)
        alone = [decoder.generate(p, max_new_tokens=20) for p in prompts]
        together = decoder.generate(prompts, max_new_tokens=20)
        assert [r.token_ids for r in together] == [r.token_ids for r in alone] == plain, name
        assert [r.stats.accepted for r in together] == [r.stats.accepted for r in alone], name
        if name == "perturbed":  # ragged acceptance: rows accept different numbers of drafts
            assert len({round(r.stats.alpha, 3) for r in together}) > 1
    target_only = SpeculativeDecoder(target).generate(prompts, max_new_tokens=20)
    assert [r.token_ids for r in target_only] == plain


@pytest.mark.parametrize("quantize", ["int8", "int4", "w8a32"])
def test_quantized_batched_greedy_equals_single_request(tiny_pair, quantize):
    """int8, and int4 with its compiled layer: rows of different lengths, prefilled together and
    verified together (ragged acceptance), each get the tokens they get alone."""
    target = load(tiny_pair["target"], quantize=quantize)
    prompts = batch_prompts(1, target.vocab_size, count=5)
    plain = [SpeculativeDecoder(target).generate(p, max_new_tokens=16).token_ids for p in prompts]
    for drafter in (make_drafter("model", load(tiny_pair["perturbed"], quantize=quantize)), make_drafter("ngram")):
        decoder = SpeculativeDecoder(target, drafter, gamma=3)
        together = decoder.generate(prompts, max_new_tokens=16)
        assert [r.token_ids for r in together] == plain
    assert [r.token_ids for r in SpeculativeDecoder(target).generate(prompts, max_new_tokens=16)] == plain


@pytest.mark.slow
def test_batched_greedy_on_the_bundled_pair():
    import json

    from specdec.defaults import default_model, heldout_prompts

    target, draft = load(default_model("target"), dtype="float64"), load(default_model("draft"), dtype="float64")
    prompts = [item["prompt"] for item in json.loads(heldout_prompts().read_text())[:8]]
    decoder = SpeculativeDecoder(target, draft, gamma=4)
    together = decoder.generate(prompts, max_new_tokens=24)
    alone = [SpeculativeDecoder(target).generate(p, max_new_tokens=24) for p in prompts]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [r.text for r in together] == [r.text for r in alone]


@pytest.mark.parametrize("rule", ["coupled", "rejection"])
@pytest.mark.parametrize("drafter_kind", ["model", "ngram", "staged"])
def test_per_request_seeds_give_the_same_samples_alone_and_in_any_batch(drafter_kind, rule):
    """Rejection-sampled chains are verified in one pass over the batch (verify_batch.py), each
    with its own generator; coupled ones request by request."""
    target = table_model(6, seed=100)
    decoder = SpeculativeDecoder(target, table_drafter(drafter_kind, 6), gamma=3)
    prompts = [[start, *PROMPT] for start in range(5)]
    samplings = [SamplingParams(temperature=1.0, seed=40 + i, max_new_tokens=12 + i, top_k=4 * (i % 2),
                                sampling_rule=rule) for i in range(5)]
    alone = [decoder.generate(p, s).token_ids for p, s in zip(prompts, samplings, strict=True)]
    assert len(set(map(tuple, alone))) > 1
    together = [r.token_ids for r in decoder.generate(prompts, samplings)]
    order = [3, 0, 4, 1]  # another batch, another order, one request left out
    shuffled = [r.token_ids for r in decoder.generate([prompts[i] for i in order], [samplings[i] for i in order])]
    assert together == alone
    assert shuffled == [alone[i] for i in order]


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["coupled", "rejection"])
def test_law_of_every_row_of_a_batch(rule):
    """Chi-square per row: 4 rows with different prompts and sampling, decoded together (with the
    rejection rule the batch's chains are verified in one pass)."""
    vocab, length, samples = 6, 3, 6000
    target = table_model(vocab, seed=100)
    decoder = SpeculativeDecoder(target, table_drafter("model", vocab), gamma=2)
    cases = list(SAMPLING_CASES.values())[:4]
    prompts = [[row, *PROMPT] for row in range(4)]
    laws = [exact_sequence_law(target, p, length, s) for p, s in zip(prompts, cases, strict=True)]
    counts = [dict.fromkeys(law, 0) for law in laws]
    for seed in range(samples):
        samplings = [dataclasses.replace(s, seed=seed * 4 + row, max_new_tokens=length, sampling_rule=rule)
                     for row, s in enumerate(cases)]
        for row, result in enumerate(decoder.generate(prompts, samplings)):
            counts[row][tuple(result.token_ids)] += 1
    for row, (law, count) in enumerate(zip(laws, counts, strict=True)):
        assert_matches_law(count, law, f"row {row}")


@pytest.mark.parametrize("policy", [name for name in POLICIES if name != "cost"])
def test_repeated_generate_with_one_seed_gives_one_output(policy):
    """Each generation starts from a fresh copy of the policy (its learned state used to leak).
    (The cost policy decides from measured times, so its draft lengths, and with them the exact
    sample, may differ between runs: its freshness is checked below.)"""
    target = table_model(6, seed=100)
    decoder = SpeculativeDecoder(target, table_drafter("model", 6), gamma=3, policy=policy)
    sampling = SamplingParams(temperature=1.0, seed=5, max_new_tokens=40)
    first = decoder.generate(PROMPT, sampling)
    for _ in range(3):
        again = decoder.generate(PROMPT, sampling)
        assert again.token_ids == first.token_ids
        assert again.stats.drafted_at == first.stats.drafted_at  # the same draft lengths, step by step


@pytest.mark.parametrize("policy", ["cost", "tree-cost"])
def test_a_new_generation_learns_acceptance_afresh_and_keeps_measured_seconds(policy):
    """What a cost policy learned of the text stays with its generation; the seconds it measured
    (the models' and the machine's) serve the next generation of the same decoder."""
    decoder = SpeculativeDecoder(table_model(6, seed=100), table_drafter("model", 6), gamma=3, policy=policy)
    first = decoder.engine.new_policy()
    assert not first.costs.verify.cells
    decoder.generate(PROMPT, SamplingParams(temperature=1.0, seed=5, max_new_tokens=40))
    fresh = decoder.engine.new_policy()
    acceptance = fresh.acceptance
    assert acceptance.accepted_given_reached == [] and acceptance.wider == {}
    assert fresh.costs.verify.cells and fresh.costs is decoder.engine.new_policy().costs


def test_two_open_streams_on_one_decoder_are_independent(tiny_pair):
    target = load(tiny_pair["target"], dtype="float64")
    decoder = SpeculativeDecoder(target, load(tiny_pair["perturbed"], dtype="float64"), gamma=4)
    first, second = [5, 6, 7], [9, 1, 2, 3, 4]
    expected = [decoder.generate(p, max_new_tokens=30).token_ids for p in (first, second)]
    streams = [decoder.stream(first, max_new_tokens=30), decoder.stream(second, max_new_tokens=30)]
    tokens: list[list[int]] = [[], []]
    done = [False, False]
    while not all(done):
        for index, stream in enumerate(streams):
            if done[index]:
                continue
            chunk = next(stream)
            tokens[index] += chunk.token_ids
            done[index] = chunk.result is not None
        decoder.generate([1, 2], max_new_tokens=5)  # a third user in between
    assert tokens == expected


def test_generate_checks_its_batch_arguments(tiny_pair):
    decoder = SpeculativeDecoder(load(tiny_pair["target"]))
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        decoder.generate([[1], [2], [3]], [SamplingParams(), SamplingParams()])
    with pytest.raises(TypeError, match="unknown generation options"):
        decoder.generate([1, 2], temprature=1.0)


@pytest.mark.parametrize("kind", ["model", "tree"])
def test_a_draft_model_drafts_a_batch_in_one_forward_a_round(tiny_pair, monkeypatch, kind):
    """Every request of a step drafts in lockstep in its own row of one draft cache: one draft
    forward a round for the whole batch (each row's missing context, then each drafted token or
    tree depth), where request by request it took one a request. Each request's draft (tokens,
    q) is what it drafts alone, after the prefill and after steps, and its row is free again once
    it is gone. Mutation, checked: propose_many as a loop of single proposals fails the count."""
    import gc

    import torch

    target, draft = load(tiny_pair["target"], dtype="float64"), load(tiny_pair["perturbed"], dtype="float64")
    drafter = make_drafter(kind, draft, target=target, tree_budget=6)
    engine = SpeculativeDecoder(target, drafter, gamma=3).engine
    forwards = []
    model_forward = drafter.model.forward
    monkeypatch.setattr(drafter.model, "forward",
                        lambda *args, **kwargs: forwards.append(1) or model_forward(*args, **kwargs))

    def counted_step(requests, cache):
        forwards.clear()
        engine.step(requests, cache)
        assert len(forwards) == 3 if kind == "model" else 1 <= len(forwards) <= 3  # gamma 3: at most 3 rounds

    for steps in (0, 3):
        together = drafts_after(engine, drafter, list(range(5)), steps, counted_step)
        assert all(draft.num_nodes for draft in together)
        for index in range(5):
            alone = drafts_after(engine, drafter, [index], steps, counted_step)[0]
            assert torch.equal(alone.tokens, together[index].tokens), (steps, index)
            assert alone.parents == together[index].parents
            assert torch.allclose(alone.probs, together[index].probs, rtol=0, atol=1e-12), (steps, index)
    gc.collect()
    assert drafter.rows.cache.rows == 8 and sorted(drafter.rows.free_rows) == list(range(8))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_the_targets_own_whatever_drafted_them(tiny_pair, temperature):
    """Each generated token's log-probability and its top 3, from the verify forward: with a draft
    model (chain and tree) or n-gram lookup, alone or in a batch, bit for bit what target-only
    decoding reports (a token scored inside a verify block gets the logits it gets alone), which
    is the log-softmax of the target's logits; greedy tokens are their own top alternative.
    Mutation, checked: taking the rows of the drafted nodes instead of those that predicted each
    emitted token (kept) fails it."""
    import math

    target = load(tiny_pair["target"])
    prompts = batch_prompts(3, target.vocab_size, count=4)
    samplings = [SamplingParams(temperature=temperature, seed=seed, max_new_tokens=10, logprobs=3) for seed in range(4)]
    plain = SpeculativeDecoder(target).generate(prompts, samplings)
    for result in plain:
        assert len(result.logprobs) == len(result.token_ids)
        for entry, token in zip(result.logprobs, result.token_ids, strict=True):
            assert entry.token == token and len(entry.top) == 3
            assert entry.top[0][1] >= entry.logprob and sum(math.exp(value) for _, value in entry.top) <= 1 + 1e-9
            if temperature == 0:
                assert entry.top[0] == (token, entry.logprob)
    draft = load(tiny_pair["perturbed"])
    for kind in ("model", "tree", "ngram"):
        decoder = SpeculativeDecoder(target, make_drafter(kind, None if kind == "ngram" else draft, tree_budget=6),
                                     gamma=3)
        together = decoder.generate(prompts, samplings)
        assert [r.logprobs for r in together] == [r.logprobs for r in plain]
        assert kind == "ngram" or sum(r.stats.accepted for r in together) > 0  # verify blocks of several tokens
        assert decoder.generate(prompts[1], samplings[1]).logprobs == plain[1].logprobs


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("kind", ["model", "tree"])
def test_a_step_verifies_its_batch_in_one_pass(tiny_pair, monkeypatch, kind, temperature):
    """Greedy chains and trees, rejection-sampled ones and the coupled rule's, of 5 requests, are
    verified in one pass a step (the walk: greedy and coupled; the ragged rejection sampler), never
    a call per request, and the texts are what each request gets alone. Mutation, checked: a walk
    per request fails the batch sizes."""
    from specdec.core import verify_batch

    target = load(tiny_pair["target"], dtype="float64")
    drafter = make_drafter(kind, load(tiny_pair["perturbed"], dtype="float64"), tree_budget=6)
    prompts = [[(5 * i + 3 * j) % target.vocab_size for j in range(4 + i)] for i in range(5)]
    decoder = SpeculativeDecoder(target, drafter, gamma=3)
    walked = []  # the batch size of each walk
    walk = verify_batch.greedy_verify_ragged
    monkeypatch.setattr(verify_batch, "greedy_verify_ragged", lambda drafts, *args: walked.append(len(drafts)) or
                        walk(drafts, *args))
    monkeypatch.setattr(verify_batch, "verify_request", None)  # (the reference: never on an engine's path)
    for rule in ("rejection", "coupled"):
        samplings = [SamplingParams(temperature=temperature, seed=i, sampling_rule=rule, max_new_tokens=10)
                     for i in range(5)]
        alone = [decoder.generate(p, s).token_ids for p, s in zip(prompts, samplings, strict=True)]
        walked.clear()
        together = [result.token_ids for result in decoder.generate(prompts, samplings)]
        assert together == alone, rule
        walks = temperature == 0.0 or rule == "coupled"
        assert (max(walked) == 5) if walks else not walked, (rule, walked)
