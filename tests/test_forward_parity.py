"""The lean forward matches transformers' logits: prefill, one-token decode, k-token blocks."""

import pytest
import torch
from tiny import save_random_model

from specdec.models import load

CONFIGS = {
    "llama": dict(model_type="llama"),
    "llama-tied-bias": dict(model_type="llama", tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    "llama-linear-rope": dict(
        model_type="llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    ),
    "llama3-rope": dict(
        model_type="llama",
        rope_parameters={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
            "rope_theta": 500000.0,
        },
    ),
    "llama-yarn-rope": dict(
        model_type="llama",
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "rope_theta": 10000.0,
        },
    ),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "mistral": dict(model_type="mistral"),
    "mistral-sliding-window": dict(model_type="mistral", sliding_window=6),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def both_backends(request, model_dir):
    settings = dict(CONFIGS[request.param])
    folder = save_random_model(model_dir / f"parity-{request.param}", settings.pop("model_type"), seed=3, **settings)
    lean = load(folder, backend="specdec")
    reference = load(folder, backend="transformers")
    assert lean.backend == "specdec" and reference.backend == "transformers"
    return lean, reference


def reference_logits(model, tokens):
    """Full-sequence transformers forward, no cache: the slow, obviously-correct reference."""
    with torch.no_grad():
        return model.network.model(input_ids=tokens[None]).logits[0]


def test_prefill_decode_and_blocks_match(both_backends):
    lean, reference = both_backends
    torch.manual_seed(0)
    tokens = torch.randint(0, lean.vocab_size, (40,))
    expected = reference_logits(reference, tokens)
    cache = lean.new_cache()
    # prefill 9, one-token decodes, then blocks of k at growing offsets
    pieces, start = [], 0
    for size in [9, 1, 1, 4, 1, 8, 3, 5, 1, 7]:
        pieces.append(lean.extend(tokens[start : start + size], cache))
        start += size
    assert start == tokens.shape[0]
    torch.testing.assert_close(torch.cat(pieces), expected, atol=1e-4, rtol=0)


def test_rollback_then_new_block_matches(both_backends):
    """Crop the cache (rejected drafts) and write different tokens at the same positions."""
    lean, reference = both_backends
    torch.manual_seed(1)
    tokens = torch.randint(0, lean.vocab_size, (30,))
    garbage = torch.randint(0, lean.vocab_size, (6,))
    cache = lean.new_cache()
    lean.extend(tokens[:20], cache)
    lean.extend(garbage, cache)
    cache.rollback(0, 20)
    block = lean.extend(tokens[20:], cache)
    torch.testing.assert_close(block, reference_logits(reference, tokens)[20:], atol=1e-4, rtol=0)


def test_adapter_cache_rollback_matches(both_backends):
    _, reference = both_backends
    torch.manual_seed(2)
    tokens = torch.randint(0, reference.vocab_size, (24,))
    cache = reference.new_cache()
    reference.extend(tokens[:16], cache)
    reference.extend(torch.randint(0, reference.vocab_size, (5,)), cache)
    cache.rollback(0, 16)
    torch.testing.assert_close(
        reference.extend(tokens[16:], cache), reference_logits(reference, tokens)[16:], atol=1e-4, rtol=0
    )


def test_sharded_checkpoint_loads(model_dir):
    from transformers import AutoModelForCausalLM

    folder = save_random_model(model_dir / "unsharded", "llama", seed=4)
    sharded = model_dir / "sharded"
    AutoModelForCausalLM.from_pretrained(str(folder)).save_pretrained(str(sharded), max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    tokens = torch.arange(10)
    one, many = load(folder), load(sharded)
    torch.testing.assert_close(one.extend(tokens, one.new_cache()), many.extend(tokens, many.new_cache()))


def test_int8_quantized_forward_is_close(model_dir):
    folder = save_random_model(model_dir / "int8", "llama", seed=5, init_scale=0.05)
    full, quantized = load(folder), load(folder, quantize="int8")
    tokens = torch.arange(12)
    full_logits = full.extend(tokens, full.new_cache())
    int8_logits = quantized.extend(tokens, quantized.new_cache())
    assert not torch.equal(full_logits, int8_logits)  # it really ran the quantized path
    assert (full_logits - int8_logits).abs().max() < 0.05 * full_logits.abs().max()


@pytest.mark.parametrize("quantize", ["int8", "int4", "w8a32"])
@pytest.mark.parametrize("model_type, settings", [("llama", {}), ("mistral", {"sliding_window": 6})])
def test_int8_block_scores_each_token_exactly_as_alone(model_dir, model_type, settings, quantize):
    """Speculative greedy output equals target-only output only if a verify block gives each
    token bit-for-bit the logits it gets alone (int8, and int4's kernel)."""
    folder = save_random_model(model_dir / f"int8-rows-{model_type}", model_type, seed=6, **settings)
    model = load(folder, quantize=quantize)
    assert model.precision == quantize
    tokens = torch.arange(3, 23)
    block_cache, single_cache = model.new_cache(), model.new_cache()
    model.extend(tokens[:8], block_cache)
    model.extend(tokens[:8], single_cache)
    block = model.extend(tokens[8:], block_cache)
    alone = torch.cat([model.extend(tokens[i : i + 1], single_cache) for i in range(8, 20)])
    assert torch.equal(block, alone)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_forward_runs(model_dir, dtype):
    folder = save_random_model(model_dir / f"half-{dtype}", "llama", seed=6, init_scale=0.05)
    full, half = load(folder), load(folder, dtype=dtype)
    tokens = torch.arange(8)
    half_logits = half.extend(tokens, half.new_cache())
    assert half_logits.dtype == getattr(torch, dtype)
    full_logits = full.extend(tokens, full.new_cache())
    assert (half_logits.float() - full_logits).abs().max() < 0.05 * full_logits.abs().max() + 0.05
