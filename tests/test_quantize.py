"""The int8 linear's kernels, on the CPU this runs on: whatever the self-check lets run returns the
exact integer products, on inputs built to saturate, with every row of a block equal to that row
alone (the batch invariance greedy equality rests on); a wrong kernel is refused with one line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec.models import int8_kernels, quantize
from specdec.models.int8_kernels import CANDIDATES, Int8Kernel, KernelCache, check_kernel


def _saturating_case(out_features: int, in_features: int, rows: int, seed: int):
    """A float linear whose int8 weights are all +-127 and activations whose per-row int8 values
    sit at the ends of their range: the inputs a 16-bit saturating kernel gets wrong."""
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (out_features, in_features), generator=generator) * 2.0 - 1
    linear = torch.nn.Linear(in_features, out_features, bias=True)
    linear.weight.data = signs * 0.02
    x = torch.randn(rows, in_features, generator=generator).sign() * 3.0  # every entry at +-max of its row
    x[0] = 3.0 * signs[0]  # every product of row 0 and channel 0 positive and largest
    return linear, x


def _exact_reference(linear: torch.nn.Linear, x: torch.Tensor, activation_max: int) -> torch.Tensor:
    """Int8Linear's formula with the integer product in float64 (exact), as an oracle."""
    weight = linear.weight.detach().double()
    weight_scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
    weight_int = torch.round(weight / weight_scale[:, None])
    row_scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / activation_max
    rows_int = torch.round(x / row_scale.float()).double()
    product = (rows_int @ weight_int.t()).float()
    return product * row_scale.float() * weight_scale.float() + linear.bias.detach()


@pytest.mark.parametrize("shape", [(96, 160), (512, 1536)])
def test_the_chosen_kernel_is_exact_on_saturation_prone_inputs(monkeypatch, shape):
    """Mutation note: with the 8-bit range forced onto oneDNN's packed kernel on a CPU without
    VNNI (`monkeypatch.setattr(quantize.KERNELS, "get", lambda *s: KernelChoice(PACKED_8_BIT,
    {}, {}))`), this fails by ~1e6 in the integer products (seen on an AVX2-only AMD EPYC)."""
    monkeypatch.setattr(quantize, "KERNELS", KernelCache(None))
    linear, x = _saturating_case(*shape, rows=9, seed=sum(shape))
    layer = quantize.Int8Linear.of(linear)
    out = layer(x)
    assert torch.equal(out, _exact_reference(linear, x, layer.kernel.activation_max))
    assert torch.equal(torch.cat([layer(x[i:i + 1]) for i in range(9)]), out)


@pytest.mark.parametrize("kernel", CANDIDATES, ids=lambda kernel: kernel.name)
def test_every_kernel_the_check_passes_is_exact_and_every_one_it_refuses_is_wrong(kernel):
    """The check's verdict on this CPU agrees with an independent exact computation: a passed
    kernel gives the exact products in an Int8Linear on saturating inputs, a refused one
    (unless simply unavailable here) does not, at the shape the check refused it for."""
    verdict = check_kernel(kernel, 256, 1536)
    linear, x = _saturating_case(256, 1536, rows=8, seed=3)
    if verdict is not None and verdict.startswith("unavailable"):
        pytest.skip(f"{kernel.name}: {verdict}")
    layer = quantize.Int8Linear.of(linear, kernel=kernel)
    exact = torch.equal(layer(x), _exact_reference(linear, x, kernel.activation_max))
    assert exact == (verdict is None), f"{kernel.name}: check says {verdict!r}, exact here: {exact}"


def _saturating_int16_pairs(rows_int: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What `vpmaddubsw` does without VNNI: u8 (x + 128) times s8, each pair of products added
    into a saturating int16, then summed exactly and the zero point taken back out."""
    shifted = (rows_int + 128).to(torch.int32)  # [rows, in]
    products = shifted[:, None, :] * weight.to(torch.int32)[None]  # [rows, out, in]
    pairs = products.reshape(*products.shape[:2], -1, 2).sum(-1).clamp(-32768, 32767)
    return (pairs.sum(-1) - 128 * weight.to(torch.int32).sum(1)).float()


# Exact by construction on every CPU (float64 holds these integer sums exactly): the fallback the
# injected wrong kernels must lose to. Not torch._int_mm, which saturates like oneDNN's AVX2 path
# under ONEDNN_MAX_CPU_ISA=AVX2 (seen on an AMX Xeon).
REFERENCE = Int8Kernel("reference-8bit", 127, lambda weight: weight,
                       lambda rows, weight: (rows.double() @ weight.double().t()).float(), "float64 products")
SATURATING = Int8Kernel("saturating-8bit", 127, lambda weight: weight, _saturating_int16_pairs,
                        "a kernel that adds pairs of products in saturating int16")
ROW_DEPENDENT = Int8Kernel("row-dependent-8bit", 127, lambda weight: weight,
                           lambda rows, weight: REFERENCE.matmul(rows, weight) + (rows.shape[0] > 4),
                           "a kernel whose rows change with the block size")


@pytest.mark.parametrize("wrong", [SATURATING, ROW_DEPENDENT], ids=lambda kernel: kernel.name)
def test_the_self_check_refuses_a_wrong_kernel_and_says_so_in_one_line(monkeypatch, wrong):
    """Injected as the fastest candidate, the wrong kernel is refused, the layer runs on an exact
    one, and the notice names both in one line. Mutation note: `choose` without the check
    (problem = None) picks the wrong kernel and fails the first assertion."""
    monkeypatch.setattr(quantize, "KERNELS", KernelCache(None))
    monkeypatch.setattr(int8_kernels, "CANDIDATES", [wrong, REFERENCE])
    timings = {wrong.name: 1.0, REFERENCE.name: 2.0}
    monkeypatch.setattr(int8_kernels, "time_kernel", lambda kernel, *shape: timings[kernel.name])
    linear, x = _saturating_case(32, 48, rows=6, seed=1)
    layer = quantize.Int8Linear.of(linear)
    assert layer.kernel is REFERENCE
    assert torch.equal(layer(x), _exact_reference(linear, x, 127))
    notice = quantize.kernel_notice()
    assert "\n" not in notice and wrong.name in notice and REFERENCE.description in notice
    assert f"{wrong.name}: wrong products for" in notice


def test_with_no_exact_kernel_loading_int8_is_an_error(monkeypatch):
    monkeypatch.setattr(quantize, "KERNELS", KernelCache(None))
    monkeypatch.setattr(int8_kernels, "CANDIDATES", [SATURATING])
    with pytest.raises(RuntimeError, match="no int8 kernel is exact"):
        quantize.Int8Linear.of(torch.nn.Linear(48, 32))


def test_choices_are_cached_per_machine_and_shape(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    first = KernelCache().get(40, 24)
    assert (tmp_path / "int8-kernels.json").is_file()
    monkeypatch.setattr(int8_kernels, "choose", lambda *args: pytest.fail("re-checked a cached shape"))
    assert KernelCache().get(40, 24).kernel is first.kernel
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "SSE41")  # another ISA cap is another machine
    with pytest.raises(pytest.fail.Exception):
        KernelCache().get(40, 24)


ISA_CAPS = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("ONEDNN_MAX_CPU_ISA") is not None, reason="already running under the ISA caps")
def test_the_int8_and_exactness_tests_pass_under_the_avx2_caps(tmp_path):
    """What an AVX2-only user gets, on any x86 machine: the caps really cap dispatch (oneDNN says
    so in its verbose line, ATen in its capability), and the int8, int4 and w8a32 kernel and
    exactness tests pass."""
    env = {**os.environ, **ISA_CAPS, "SPECDEC_CACHE": str(tmp_path)}
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability()); "
                            "from specdec.models import int8_kernels as k; k.check_kernel(k.PACKED_7_BIT, 8, 16)"],
                           env={**env, "ONEDNN_VERBOSE": "1"}, capture_output=True, text=True, check=True)
    assert probe.stdout.splitlines()[0] in ("AVX2", "DEFAULT"), probe.stdout
    isa_lines = [line for line in probe.stdout.splitlines() if "isa:" in line]
    assert isa_lines and "AVX-512" not in isa_lines[0] and "AMX" not in isa_lines[0], isa_lines
    tests = Path(__file__).parent
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "0",
            "-p",
            "no:cacheprovider",
            str(tests / "test_quantize.py"),
            str(tests / "test_int4.py"),  # the int4 kernel's AVX2 build (ATEN_CPU_CAPABILITY caps its -march)
            str(tests / "test_w8a32.py"),  # and the w8a32 kernel's
            str(tests / "test_forward_parity.py") + "::test_int8_block_scores_each_token_exactly_as_alone",
            str(tests / "test_model_interface.py") + "::test_int8_tree_nodes_are_bit_identical_to_their_chains",
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=tests.parent,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
