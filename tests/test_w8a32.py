"""The w8a32 kernel (specdec/models/w8a32.py): a 4- or 8-bit GGUF's weights held exactly, products
within float32 rounding of float64, rows alone as in a block, the same bits on every instruction-set
path; refused, with a notice, when wrong."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from isa_paths import ON_AVX2, outputs_per_path
from safetensors.torch import load_file, save_file
from tiny import save_random_model
from torch import nn

from specdec.models import w8a32
from specdec.models.fused_layer import FusedDecoderLayer, FusedOutput
from specdec.models.loading import load
from specdec.models.precisions import quantize_linears
from specdec.models.w8a32 import W8A32Linear, check_kernel, dequantized, kernel_linear, pack_weight


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # each test checks (and builds) afresh


def _gguf_weights(kind: GGMLQuantizationType, shape=(40, 96), seed=0) -> torch.Tensor:
    """Random weights through gguf's own quantizer and back: what a dequantized GGUF holds."""
    weight = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return torch.from_numpy(quants.dequantize(quants.quantize(weight, kind), kind).copy())


def test_k_quant_sub_blocks_are_held_exactly():
    """Q4_K / Q5_K: 32 values a sub-block at levels scale * q - min whose q need not span 0..15
    (gguf cannot write K-quants, so built here the way its dequantizer computes them); the groups
    that span 0..15 take the Q4_1 form, the others steps of their smallest gap. Mutation checked:
    without the smallest-gap form the 11 of these 64 groups that do not span 0..15 are not held."""
    generator = torch.Generator().manual_seed(5)
    levels = torch.randint(0, 16, (32, 64), generator=generator).float()
    sub_scale = torch.tensor([0.0123, 0.0371]).half().float().repeat_interleave(32)  # d * sc: float16 x 6 bits
    sub_min = torch.tensor([0.25, 0.0625]).repeat_interleave(32)
    weight = levels * sub_scale - sub_min
    spanning = (levels.reshape(32, 2, 32).amin(-1) == 0) & (levels.reshape(32, 2, 32).amax(-1) == 15)
    assert 0 < int(spanning.sum()) < 64
    packed = pack_weight(weight)
    assert bool(packed.exact.all())
    assert torch.equal(dequantized(packed).float(), weight)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_a_gguf_s_4_and_8_bit_weights_are_held_exactly(kind):
    """Mutation checked: without the symmetric 4- and 5-bit forms (largest / 8, / 16) Q4_0 and Q5_0 fail."""
    weight = _gguf_weights(GGMLQuantizationType[kind])
    packed = pack_weight(weight)
    assert bool(packed.exact[:40].all())
    assert torch.equal(dequantized(packed)[:40].float(), weight)


def test_other_weights_get_8_bit_groups_and_say_so():
    weight = torch.randn(16, 64)
    packed = pack_weight(weight)
    assert not bool(packed.exact.any())
    error = (dequantized(packed).float() - weight).abs()
    assert bool((error <= packed.scale.repeat_interleave(32, dim=1) * 0.5 + 1e-6).all())  # half a step of 8 bits


@pytest.mark.parametrize("shape", [(16, 32), (40, 96), (960, 576)])
def test_the_product_is_float32_s_within_rounding_and_rows_are_alone_as_in_a_block(shape):
    weight = _gguf_weights(GGMLQuantizationType.Q4_1, shape)
    packed = pack_weight(weight)
    x = torch.randn(11, shape[1])
    x[0] *= 1e3
    got = kernel_linear(x, packed)[:, : shape[0]]
    exact = x.double() @ weight.double().T
    assert ((got.double() - exact).abs() <= 1e-5 * (x.double().abs() @ weight.double().abs().T)).all()
    for start, stop in ((0, 1), (1, 4), (3, 11), (10, 11)):
        assert torch.equal(kernel_linear(x[start:stop], packed)[:, : shape[0]], got[start:stop])


def _float16_activations(rows, packed):
    """A wrong kernel: activations rounded to float16 first (a cheaper kernel's shortcut)."""
    return kernel_linear(rows.half().float(), packed)


def _row_dependent(rows, packed):
    """A wrong kernel: right alone, a last bit off in a block (as a sum blocked by row count would be)."""
    out = kernel_linear(rows, packed)
    return out if rows.shape[0] == 1 else out * (1 + 2e-7)


def _inputs_misread(rows, packed):
    """A wrong kernel: each group's inputs k and k + 16 swapped (a layout slip)."""
    order = torch.arange(rows.shape[1]).reshape(-1, 2, 16).flip(1).reshape(-1)
    return kernel_linear(rows[:, order], packed)


@pytest.mark.parametrize("wrong, says", [(_float16_activations, "wrong results"), (_row_dependent, "differ"),
                                         (_inputs_misread, "blocks of 8-bit weights")])
def test_the_self_check_refuses_a_wrong_kernel(wrong, says):
    assert check_kernel(64, 96) is None
    assert says in check_kernel(64, 96, linear=wrong)


def test_a_wrong_kernel_falls_back_to_int8_with_a_one_line_notice(monkeypatch):
    monkeypatch.setattr(w8a32, "kernel_linear", _float16_activations)
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 16))
    quantize_linears(model, "w8a32")
    assert model.quantized == "int8"
    assert "w8a32 kernel not used" in model.quantize_notice and "\n" not in model.quantize_notice
    assert all(type(layer).__name__ == "Int8Linear" for layer in model)


def test_the_notice_counts_the_groups_held_exactly():
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 16))
    model[0].weight.data = _gguf_weights(GGMLQuantizationType.Q8_0, (32, 64))
    quantize_linears(model, "w8a32")
    assert [type(layer) for layer in model] == [W8A32Linear, W8A32Linear] and model.quantized == "w8a32"
    assert "80.0% of weight groups held exactly" in model.quantize_notice  # 64 of 80 groups: Q8_0's


# Under each build: every block size's rows equal the same rows alone; saved for the comparison
# across builds.
EVERY_BLOCK_SIZE = (
    "import sys, torch; from specdec.models import w8a32; w, x = torch.load(sys.argv[2]); "
    "x = torch.cat([x] * 4)[:33]; p = w8a32.pack_weight(w); full = w8a32.kernel_linear(x, p); "
    "sizes = [k for k in range(1, 34) if not torch.equal(w8a32.kernel_linear(x[:k], p), full[:k])]; "
    "alone = torch.cat([w8a32.kernel_linear(x[i:i + 1], p) for i in range(33)]); "
    "torch.save((w8a32.kernel_isa(), full, sizes, torch.equal(alone, full)), sys.argv[1])"
)


@pytest.mark.slow  # two more builds of the kernels (g++) and a subprocess each
@pytest.mark.skipif(not ON_AVX2, reason="the AVX2 and plain x86-64 builds need an x86 CPU with AVX2")
def test_every_instruction_set_path_gives_the_same_bits_at_every_block_size(tmp_path):
    """The AVX-512 build (where the CPU has it), the AVX2 + FMA build and the portable one
    (std::fmaf) compute the same formula: the same bits; and on each path every block size from 1
    to 33 rows scores each row as alone. Mutation checked: a portable path summing dot + x * q
    (two roundings) instead of fmaf differs."""
    outputs = outputs_per_path(tmp_path, EVERY_BLOCK_SIZE)
    assert outputs["avx2"][0] == "AVX2 + FMA" and outputs["default"][0] == "portable C++"
    for isa, full, wrong_sizes, rows_alone_equal in outputs.values():
        assert wrong_sizes == [] and rows_alone_equal, isa
        assert torch.equal(full, outputs[""][1]), isa


def test_a_model_with_gguf_weights_computes_what_float32_computes(model_dir):
    """A random qwen2-style model whose linears hold Q4_1 weights: w8a32 (compiled layers, float32
    activations) with a float32 cache gives the float32 model's logits within float32 rounding and
    its greedy tokens; int4 (int8 activations) is far further off. By default w8a32 stores keys and
    values in float16, as int4 does. Mutation checked: the compiled MLP's SiLU in float16 (or int8
    activations) fails the bound."""
    folder = save_random_model(model_dir / "w8a32-gguf", "qwen2", seed=9)
    weights = load_file(str(folder / "model.safetensors"))
    for name, tensor in weights.items():
        if name.endswith("proj.weight") or name == "lm_head.weight":
            kind = GGMLQuantizationType.Q8_0 if name == "lm_head.weight" else GGMLQuantizationType.Q4_1
            packed = quants.quantize(tensor.float().numpy(), kind)
            weights[name] = torch.from_numpy(quants.dequantize(packed, kind).copy())
    save_file(weights, str(folder / "model.safetensors"))
    reference, four_bit = load(folder), load(folder, quantize="int4", kv_dtype="float32")
    assert load(folder, quantize="w8a32").new_cache().keys.dtype == torch.float16
    fast = load(folder, quantize="w8a32", kv_dtype="float32")
    assert all(isinstance(layer, FusedDecoderLayer) for layer in fast.network.layers)
    assert isinstance(fast.network.norm_then_head, FusedOutput)
    assert "100.0% of weight groups held exactly" in fast.network.quantize_notice
    tokens = torch.arange(3, 30)
    expected = reference.extend(tokens, reference.new_cache())
    got, rounded = fast.extend(tokens, fast.new_cache()), four_bit.extend(tokens, four_bit.new_cache())
    scale = expected.abs().max()
    assert (got - expected).abs().max() < 1e-5 * scale < (rounded - expected).abs().max()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
