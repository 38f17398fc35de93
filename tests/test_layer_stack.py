"""The decoder stack in one compiled call (specdec/models/layer_stack.py, kernels/stack.cpp): every
forward's logits and hidden states equal the per-layer path's bit for bit (prompts in pieces,
verify blocks, trees, ragged batches, a head's hidden layers), for each family's layer variants in
int4 and w8a32; forwards that need SDPA's masks take the per-layer path; the check at load refuses
a stack that differs."""

import re

import pytest
import torch
from test_families import FAMILY_SETTINGS, save_family

from specdec import SpeculativeDecoder, make_drafter
from specdec.models import layer_stack
from specdec.models.base import Attention
from specdec.models.layer_stack import LayerStack, check_stack
from specdec.models.loading import load
from specdec.models.transformer import LlamaFamilyModel

PROMPTS = [[5, 9, 14, 3, 27, 8, 19, 40, 2, 11, 7, 7, 7, 7, 9, 14, 3], [12, 4, 4, 4, 4, 4, 31, 8]]


def recorded(model, run) -> tuple[list[tuple], int]:
    """(each forward's (logits, hidden) in order, how many ran in one call) while ``run()`` runs."""
    network: LlamaFamilyModel = model.network
    calls: list[tuple] = []
    stacked = [0]
    original_forward, original_stack = network.forward, network.layer_stack

    def counting_stack(*args):
        result = original_stack(*args)
        stacked[0] += result is not None
        return result

    def forward(*args, **kwargs):
        output = original_forward(*args, **kwargs)
        calls.append((output.logits, output.hidden))
        return output

    network.forward = forward
    if original_stack is not None:
        network.layer_stack = counting_stack
    try:
        run()
    finally:
        network.forward, network.layer_stack = original_forward, original_stack
    return calls, stacked[0]


def scenarios(model):
    def run():
        decoder = SpeculativeDecoder(model, make_drafter("ngram", target=model))
        for prompt in PROMPTS:
            decoder.generate(prompt, max_new_tokens=24)
        SpeculativeDecoder(model, make_drafter("ngram-tree", target=model)).generate(PROMPTS[0], max_new_tokens=24)
        decoder.generate(PROMPTS, max_new_tokens=16)  # a ragged batch
        cache = model.new_cache()
        for start in range(0, len(PROMPTS[0]), 5):  # a prompt in pieces
            model.extend(torch.tensor(PROMPTS[0][start:start + 5]), cache)
        start = int(cache.lengths[0])  # a verify block reading two layers' outputs, as a head does
        model.network(torch.tensor([3, 4]), torch.arange(start, start + 2), cache, Attention.chain(2, 0, True),
                      hidden_layers=(0, 1))
    return run


@pytest.mark.parametrize("quantize", ["int4", "w8a32"])
@pytest.mark.parametrize("name", ["llama", *FAMILY_SETTINGS])
def test_one_call_gives_every_forward_the_per_layer_bits(model_dir, name, quantize):
    from tiny import save_random_model

    folder = save_random_model(model_dir / "stack-llama", "llama", seed=3) if name == "llama" else \
        save_family(model_dir / f"stack-{name}", name)
    model = load(folder, quantize=quantize)
    assert model.network.layer_stack is not None, model.network.quantize_notice
    one_call, stacked = recorded(model, scenarios(model))
    stack = model.network.layer_stack
    model.network.layer_stack = None
    try:
        per_layer, _ = recorded(model, scenarios(model))
    finally:
        model.network.layer_stack = stack
    assert stacked >= len(one_call) // 2, (stacked, len(one_call))  # most forwards ran in one call
    assert len(one_call) == len(per_layer)
    for (logits, hidden), (expected_logits, expected_hidden) in zip(one_call, per_layer, strict=True):
        assert (logits is None) == (expected_logits is None) and (hidden is None) == (expected_hidden is None)
        assert logits is None or torch.equal(logits, expected_logits)
        assert hidden is None or torch.equal(hidden, expected_hidden)


@pytest.mark.parametrize("format", [4, 8])
def test_the_load_time_check_passes_here_and_refuses_a_wrong_or_idle_stack(monkeypatch, format):
    assert check_stack(format) is None
    original = LayerStack.__call__

    def one_ulp_off(self, *arguments):
        stacked = original(self, *arguments)
        if stacked is not None:
            stacked[0][-1] = torch.nextafter(stacked[0][-1], torch.tensor(float("inf")))
        return stacked

    monkeypatch.setattr(LayerStack, "__call__", one_ulp_off)
    # (an ulp in the last hidden state may vanish in int4's rounding of the head's input: the next forward catches it)
    assert re.fullmatch(r"forward \d: logits differ from the layers one by one", check_stack(format) or "")
    monkeypatch.setattr(LayerStack, "__call__", lambda self, *arguments: None)
    assert check_stack(format) == "the one call declined forward 1 of 4"


@pytest.mark.parametrize("quantize", ["int4", "w8a32"])
def test_a_stack_failing_its_check_leaves_the_layers_one_by_one_with_a_notice(model_dir, monkeypatch, quantize):
    from tiny import save_random_model

    monkeypatch.setattr(layer_stack, "stack_problem", lambda format: "forward 2: logits differ")
    model = load(save_random_model(model_dir / "stack-refused", "llama", seed=4), quantize=quantize)
    assert model.network.layer_stack is None and model.network.norm_then_head is not None
    notice = model.network.quantize_notice
    assert notice.endswith("; layers called one by one (the one-call stack failed its check: forward 2: logits "
                           "differ)") and "\n" not in notice
    assert model.extend(torch.tensor(PROMPTS[1]), model.new_cache()).shape == (len(PROMPTS[1]), model.vocab_size)
