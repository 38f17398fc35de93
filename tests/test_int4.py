"""The int4 kernel (specdec/models/int4.py): bit for bit what its torch reference says, on every
instruction-set path; rows alone as in a block; refused, with a notice, when wrong or unbuildable."""

import pytest
import torch
from isa_paths import ON_AVX2, outputs_per_path
from torch import nn

from specdec.models import int4, native
from specdec.models.int4 import GROUP, Int4Linear, check_kernel, kernel_linear, pack_weight, quantize_rows
from specdec.models.precisions import quantize_linears


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # each test checks (and builds) afresh


def _saturating_case(out_features: int, in_features: int, rows: int, seed: int):
    """Weights whose groups quantize to all 15s (q at the top) and random ones; activations at
    +-127 (each row's largest magnitude everywhere) and random ones."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    weight[: out_features // 2] = torch.where(weight[: out_features // 2] > 0, 2.0, -1.0)
    x = torch.randn(rows, in_features, generator=generator)
    x[0] = 3.0
    x[-1] = -3.0
    return weight, x


@pytest.mark.parametrize("shape", [(16, 32), (40, 96), (512, 1536), (48, 576)])
def test_the_kernel_returns_the_references_bits_on_saturation_prone_inputs(shape):
    """Every integer dot at its largest (127 x 15 x 32 a group) and the float sum in the
    kernel's order: the same bits as reference_matmul, and close to the float product.
    Shapes with super-blocks of 8 groups, a short last one (96: 3 groups; 1568: 6 + 1 + ... ).
    Mutation checked: summing a super-block into the AVX-512 accumulator as (acc + t1) - t2 instead
    of acc + (t1 - t2) fails this test and others."""
    weight, x = _saturating_case(*shape, rows=5, seed=0)
    packed = pack_weight(weight)
    got = kernel_linear(x, packed.records, packed.q.shape[0])
    assert torch.equal(got, int4.reference_matmul(*quantize_rows(x), packed))
    exact = (x.double() @ weight.double().t()).float()
    error = (got[:, : shape[0]] - exact).norm() / exact.norm()
    assert error < 0.1, error  # 4-bit groups of 32: a few percent on random weights


BLOCK_SIZES = range(1, 34)  # every verify block up to 32 tokens, and one past two full tiles of 16


def test_a_row_gets_the_same_bits_in_any_block():
    weight, x = _saturating_case(48, 64, rows=max(BLOCK_SIZES), seed=1)
    packed = pack_weight(weight)
    records, outputs = packed.records, packed.q.shape[0]
    block = kernel_linear(x, records, outputs)
    assert torch.equal(block, int4.reference_matmul(*quantize_rows(x), packed))
    for start, stop in ((0, 1), (3, 8), (5, 19), (18, 19), (7, 33)):
        assert torch.equal(kernel_linear(x[start:stop], records, outputs), block[start:stop])
    for rows in BLOCK_SIZES:  # every block size: its rows tiled one way (20 = 10 + 10), alone another
        assert torch.equal(kernel_linear(x[:rows], records, outputs), block[:rows]), rows


@pytest.mark.parametrize("rows", [257, 600])
def test_a_long_prompts_rows_go_through_in_panels_with_their_bits(rows):
    """Past 256 rows the kernel runs a panel of rows at a time through every column block (a
    prompt's prefill): every row the reference's bits and its bits alone, the panels' seams (row
    256 with tiles of 16; 600 rows: tiles of 15 and 16 around them) included. Mutation checked:
    panels that skip a tile between them leave rows unwritten, and fail it."""
    weight, x = _saturating_case(48, 64, rows=rows, seed=rows)
    packed = pack_weight(weight)
    records, outputs = packed.records, packed.q.shape[0]
    block = kernel_linear(x, records, outputs)
    assert torch.equal(block, int4.reference_matmul(*quantize_rows(x), packed))
    for start in (0, 200, 250, 255, 256, rows - 1):
        assert torch.equal(kernel_linear(x[start:start + 1], records, outputs), block[start:start + 1])


@pytest.mark.parametrize("in_features", [64, 320])  # one short super-block; one full and a short one
def test_packing_round_trips_the_weights_within_half_a_step(in_features):
    """Every weight within half its group's step of the original: the integer sub-scales and
    sub-mins, rounded up to whole steps of the super-block's float16 ones, cover each group's range
    (nothing clipped), the groups' ranges differing by up to 1000x within a super-block."""
    weight = torch.randn(20, in_features) * 10 ** -(3 * torch.rand(20, in_features // GROUP, 1)).repeat_interleave(
        GROUP, dim=2).reshape(20, in_features)
    packed = pack_weight(weight)
    dequantized = packed.dequantized()
    assert packed.q.shape[0] == 32 and torch.all(dequantized[20:] == 0)  # outputs padded to blocks of 16 with zeros
    steps = packed.sub_scales.float() * packed.scale.repeat_interleave(int4.SUPER, dim=1)[:, :in_features // GROUP]
    step = steps.repeat_interleave(GROUP, dim=1)[:20]
    assert torch.all((dequantized[:20] - weight).abs() <= step * 0.5 * (1 + 1e-5))
    assert packed.records.shape == (2, in_features // GROUP * 288 + -(-in_features // 256) * 64)  # 4.625 bits


def test_int4_linear_matches_the_float_linear_closely():
    linear = nn.Linear(96, 40)
    quantized = Int4Linear.of(linear)
    x = torch.randn(2, 3, 96)
    expected = linear(x)
    got = quantized(x)
    assert got.shape == expected.shape
    assert (got - expected).norm() / expected.norm() < 0.1


# Under each build: every block size's rows equal the reference and the same rows alone; saved for
# the comparison across builds.
EVERY_BLOCK_SIZE = (
    "import sys, torch; from specdec.models import int4; w, x = torch.load(sys.argv[2]); "
    "x = torch.cat([x] * 4)[:33]; p = int4.pack_weight(w); r, n = p.records, p.q.shape[0]; "
    "full = int4.kernel_linear(x, r, n); "
    "assert torch.equal(full, int4.reference_matmul(*int4.quantize_rows(x), p)); "
    "sizes = [k for k in range(1, 34) if not torch.equal(int4.kernel_linear(x[:k], r, n), full[:k])]; "
    "alone = torch.cat([int4.kernel_linear(x[i:i + 1], r, n) for i in range(33)]); "
    "torch.save((int4.kernel_isa(), full, sizes, torch.equal(alone, full)), sys.argv[1])"
)


@pytest.mark.slow  # two more builds of the kernels (g++) and a subprocess each
@pytest.mark.skipif(not ON_AVX2, reason="the AVX2 and plain x86-64 builds need an x86 CPU with AVX2")
def test_every_instruction_set_path_gives_the_same_bits_at_every_block_size(tmp_path):
    """The AVX-512 VNNI, AVX2 and portable builds (ATEN_CPU_CAPABILITY caps the build's -march)
    compute the same formula: the same bits, so a user's output does not depend on the path; and
    on each path every block size from 1 to 33 rows scores each row as alone."""
    outputs = outputs_per_path(tmp_path, EVERY_BLOCK_SIZE)
    assert outputs["avx2"][0] == "AVX2" and outputs["default"][0] == "portable C++"
    for isa, full, wrong_sizes, rows_alone_equal in outputs.values():
        assert wrong_sizes == [] and rows_alone_equal, isa
        assert torch.equal(full, outputs[""][1]), isa


def _slightly_wrong_kernel(rows, records, out_padded):
    """A wrong kernel: 1e-3 off everywhere (as a lost term or a reordered sum would be)."""
    return kernel_linear(rows, records, out_padded) + 1e-3


def _row_dependent_kernel(rows, records, out_padded):
    """A wrong kernel: right alone, but rows of a block see the block's largest activation."""
    if rows.shape[0] == 1:
        return kernel_linear(rows, records, out_padded)
    largest = rows.abs().amax()
    padded = torch.cat([rows, torch.full((1, rows.shape[1]), float(largest))])
    return kernel_linear(padded, records, out_padded)[:-1] * (1 + 1e-6)


@pytest.mark.parametrize("wrong, says", [(_slightly_wrong_kernel, "wrong results"),
                                         (_row_dependent_kernel, "wrong results")])
def test_the_self_check_refuses_a_wrong_kernel(wrong, says):
    assert check_kernel(64, 96) is None
    assert says in check_kernel(64, 96, linear=wrong)


def test_a_wrong_kernel_falls_back_to_int8_with_a_one_line_notice(monkeypatch):
    monkeypatch.setattr(int4, "kernel_linear", _row_dependent_kernel)
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 16))
    quantize_linears(model, "int4")
    assert model.quantized == "int8"
    assert "int4 kernel not used" in model.quantize_notice and "\n" not in model.quantize_notice
    assert all(type(layer).__name__ == "Int8Linear" for layer in model)


def test_without_a_compiler_int4_falls_back_to_int8_and_says_why(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler")
    native.library.cache_clear()
    try:
        model = nn.Sequential(nn.Linear(64, 32))
        quantize_linears(model, "int4")
    finally:
        native.library.cache_clear()
    assert model.quantized == "int8" and "no C++ compiler" in model.quantize_notice


def test_inputs_not_a_multiple_of_32_stay_int8():
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 16))
    quantize_linears(model, "int4")
    assert [type(layer).__name__ for layer in model] == ["Int4Linear", "Int8Linear"]
    assert model.quantized == "int4" and "1 linears with inputs not a multiple of 32 stay int8" in model.quantize_notice
