"""Greedy speculative output is token-identical to target-only greedy decoding, for every
drafter and every draft-length policy."""

import random

import pytest
import torch

from specdec import SpeculativeDecoder, load, make_drafter
from specdec.core.policy import POLICIES

DRAFT_KINDS = ("same", "independent", "perturbed")  # always, never and partly agreeing drafts
NUM_PROMPTS = 200


def load_all(tiny_pair, backend):
    # float64 so that a k-token block and k single-token forwards never flip an argmax tie.
    load_one = lambda path: load(path, dtype="float64", backend=backend)  # noqa: E731
    return load_one(tiny_pair["target"]), {kind: load_one(tiny_pair[kind]) for kind in DRAFT_KINDS}


@pytest.fixture(scope="module")
def lean_models(tiny_pair):
    return load_all(tiny_pair, "specdec")


def random_cases(seed: int, vocab_size: int, count: int = NUM_PROMPTS):
    """Random prompts, half of them with a repeated segment (so n-gram lookup finds matches)."""
    rng = random.Random(seed)
    for index in range(count):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 12))]
        if index % 2:
            prompt = prompt * 2 + prompt[: rng.randint(0, len(prompt))]
        yield prompt, rng.randint(1, 24), rng.randint(1, 8)


def check_equality(target, drafters: dict, policy: str, seed: int = 7, count: int = NUM_PROMPTS) -> dict:
    """Runs ``count`` cases through every drafter; returns accepted/drafted counts per drafter."""
    baseline = SpeculativeDecoder(target)
    counts = {name: [0, 0] for name in drafters}
    for prompt, max_new_tokens, gamma in random_cases(seed, target.vocab_size, count):
        expected = baseline.generate(prompt, max_new_tokens=max_new_tokens)
        assert expected.stats.tau == 1.0
        for name, drafter in drafters.items():
            result = SpeculativeDecoder(target, drafter, gamma=gamma, policy=policy).generate(
                prompt, max_new_tokens=max_new_tokens)
            assert result.token_ids == expected.token_ids, (name, policy, prompt, max_new_tokens, gamma)
            assert result.finish_reason == expected.finish_reason
            counts[name][0] += result.stats.accepted
            counts[name][1] += result.stats.drafted
    return counts


def test_drafters_equal_target_only_on_a_few_prompts(lean_models):
    """The fast tier's greedy identity: the slow tests' first 16 prompts, the three drafts and
    n-gram lookup, the fixed policy (the slow tests: 200 prompts, every policy and drafter, each
    backend and precision). Mutation: greedy_verify_ragged accepting every drafted child, matching
    the target's argmax or not, fails it."""
    target, drafts = lean_models
    drafters = {kind: make_drafter("model", drafts[kind]) for kind in DRAFT_KINDS}
    counts = check_equality(target, {**drafters, "ngram": make_drafter("ngram", max_n=3)}, "fixed", count=16)
    assert counts["same"][0] == counts["same"][1] > 0
    assert 0 < counts["perturbed"][0] < counts["perturbed"][1]
    assert counts["ngram"][1] > 0  # it did draft


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("drafter_kind", ["model", "staged"])
def test_model_drafters_equal_target_only(lean_models, drafter_kind, policy):
    target, drafts = lean_models
    drafters = {kind: make_drafter(drafter_kind, drafts[kind]) for kind in DRAFT_KINDS}
    counts = check_equality(target, drafters, policy)
    # The three drafts really cover always / never / partly agreeing.
    assert counts["same"][0] == counts["same"][1] > 0
    assert counts["independent"][0] < 0.2 * counts["independent"][1]
    assert 0 < counts["perturbed"][0] < counts["perturbed"][1]


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_ngram_drafter_equals_target_only(lean_models, policy):
    target, _ = lean_models
    counts = check_equality(target, {"ngram": make_drafter("ngram", max_n=3)}, policy)
    assert counts["ngram"][1] > 0  # it did draft


@pytest.mark.slow
def test_transformers_adapter_equals_target_only(tiny_pair):
    target, drafts = load_all(tiny_pair, "transformers")
    assert target.backend == "transformers"
    counts = check_equality(target, {kind: make_drafter("model", drafts[kind]) for kind in DRAFT_KINDS}, "fixed")
    assert counts["same"][0] == counts["same"][1] > 0
    assert 0 < counts["perturbed"][0] < counts["perturbed"][1]


@pytest.mark.slow
@pytest.mark.parametrize("quantize", ["int8", "int4", "w8a32"])
def test_int8_models_equal_int8_target_only(tiny_pair, quantize):
    # int8 activations amplify float noise unless a token is scored the same in a block as alone;
    # int4 and w8a32 store keys and values in float16 (the compiled attention widens them): 16-bit KV too
    load_one = lambda path: load(path, quantize=quantize)  # noqa: E731
    target, drafts = load_one(tiny_pair["target"]), {kind: load_one(tiny_pair[kind]) for kind in DRAFT_KINDS}
    assert (target.new_cache().keys.dtype == torch.float16) == (quantize in ("int4", "w8a32"))
    counts = check_equality(target, {kind: make_drafter("model", drafts[kind]) for kind in DRAFT_KINDS}, "fixed")
    assert counts["same"][0] == counts["same"][1] > 0
    assert 0 < counts["perturbed"][0] < counts["perturbed"][1]


def test_stream_chunks_add_up_to_the_result(lean_models):
    target, drafts = lean_models
    decoder = SpeculativeDecoder(target, drafts["perturbed"], gamma=4)
    chunks = list(decoder.stream([5, 6, 7], max_new_tokens=30))
    result = chunks[-1].result
    assert result is not None and all(chunk.result is None for chunk in chunks[:-1])
    assert [t for chunk in chunks for t in chunk.token_ids] == result.token_ids
    assert "".join(chunk.text for chunk in chunks) == result.text
    sources = [s.value for chunk in chunks for s in chunk.sources]
    assert len(sources) == len(result.token_ids)
    # every chunk ends with exactly one token of the target's own
    for chunk in chunks[:-1]:
        assert [s.value for s in chunk.sources[:-1]] == ["draft"] * (len(chunk.sources) - 1)
        assert chunk.sources[-1].value in ("correction", "bonus")
