"""The bundled default pair: transformers agrees with specdec, speculation is lossless on it."""

import json

import pytest
import torch

from specdec import SpeculativeDecoder, defaults, load, make_drafter
from specdec.defaults import default_model


@pytest.fixture(scope="module")
def pair():
    # float64: a k-token block and k single-token forwards must not flip a near-tie argmax
    return load(default_model("target"), dtype="float64"), load(default_model("draft"), dtype="float64")


@pytest.fixture(scope="module")
def heldout_prompts():
    return [item["prompt"] for item in json.loads(defaults.heldout_prompts().read_text())]


@pytest.mark.slow
def test_transformers_gives_the_same_greedy_continuation(pair, heldout_prompts):
    from transformers import AutoModelForCausalLM

    target, _ = pair
    reference = AutoModelForCausalLM.from_pretrained(str(default_model("target")), dtype=torch.float64).eval()
    ours = SpeculativeDecoder(target)
    for prompt in heldout_prompts[:3]:
        prompt_ids = target.tokenizer.encode(prompt)
        theirs = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=24, do_sample=False,
                                    eos_token_id=None, pad_token_id=target.tokenizer.pad_token_id)
        mine = ours.generate(prompt_ids, max_new_tokens=24)
        expected = theirs[0, len(prompt_ids):].tolist()
        # specdec stops at EOS; transformers was told not to, so compare up to specdec's end
        assert mine.token_ids == expected[: len(mine.token_ids)]


@pytest.mark.slow
@pytest.mark.parametrize("drafter_kind", ["model", "staged", "ngram"])
def test_speculation_is_lossless_on_heldout_prompts(pair, heldout_prompts, drafter_kind):
    target, draft = pair
    baseline = SpeculativeDecoder(target)
    decoder = SpeculativeDecoder(target, make_drafter(drafter_kind, draft), gamma=5)
    accepted = 0
    for prompt in heldout_prompts[:6]:
        expected = baseline.generate(prompt, max_new_tokens=32)
        result = decoder.generate(prompt, max_new_tokens=32)
        assert result.token_ids == expected.token_ids and result.text == expected.text
        accepted += result.stats.accepted
    assert accepted > 0
