"""The int8 x int8 -> exact integer matmuls an Int8Linear can run on, and the self-check that
decides, per machine and weight shape, which of them it does run on.

Why a check and not a rule: the same oneDNN op is exact on one CPU and wrong on another. Its
u8 x s8 kernels on CPUs without VNNI (AVX2 only: most AMD EPYCs before Zen 4, many laptops)
multiply with `vpmaddubsw`, which adds each pair of u8 x s8 products into a *saturating int16*:
255 x 127 x 2 = 64770 does not fit, so 8-bit activations (shifted to u8 by a zero point of 128)
against weights near +-127 give garbage (measured on a 2-core AMD EPYC, AVX2: a one-row product
off by 2e6 where the exact answer was about 1.5e6; the default model printed junk). With 7-bit
activations (-63..63, zero point 64, so u8 <= 127) a pair is at most 127 x 127 x 2 = 32258, and
the same kernel is exact there: x86 quantizers call this "reduce_range".

So every candidate (kernel, activation range) is run once on the real shape against an exact
integer reference, with inputs built to saturate (activations at the ends of their range against
weights of +-127) and random ones, for several block sizes, and a block's rows are compared with
each row alone. Candidates that pass are timed; the fastest runs, except that the 8-bit range is
kept while it costs at most 1.25x the fastest (it rounds activations half as coarsely). The
choices are cached in ``$SPECDEC_CACHE/int8-kernels.json`` under a key of the CPU, its flags, the
torch build and the ISA caps (`ONEDNN_MAX_CPU_ISA`, `ATEN_CPU_CAPABILITY`), so a second load is
instant and another machine checks again. A kernel that fails never runs: junk is never silent.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.machine import cache_root, cached_measurement

# Activation row counts of the check: one token, verify blocks, and a prefill-sized call (oneDNN
# chooses its kernel by shape, so each size range is checked on the path it actually takes).
CHECK_ROWS = (1, 3, 8, 40)
CHECK_MAX_OUT = 4096
PREFER_8_BIT_WITHIN = 1.25


@dataclass(frozen=True)
class Int8Kernel:
    """rows_int [rows, in] float32 holding integers in -activation_max..activation_max, times an
    int8 weight [out, in] prepared by `prepare`, as float32 [rows, out]: the exact int32 products
    converted to float32 (as `torch._int_mm(...).float()` does)."""

    name: str
    activation_max: int
    prepare: Callable[[torch.Tensor], torch.Tensor]  # int8 [out, in] -> the stored weight
    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (rows_int [rows, in], stored) -> [rows, out]
    description: str


def _int_mm(rows_int: torch.Tensor, weight_int8: torch.Tensor) -> torch.Tensor:
    # The transposed view (no copy) keeps one-row products at the memory-bandwidth limit.
    return torch._int_mm(rows_int.to(torch.int8), weight_int8.t()).float()


def _onednn_packed(zero_point: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def matmul(rows_int: torch.Tensor, packed_weight: torch.Tensor) -> torch.Tensor:
        # Shifted to uint8 by the zero point, which oneDNN compensates in integers; unit scales
        # and zero weight zero points keep the output the raw integer products.
        unit_scales, zero_points = _unit_scales(packed_weight.size(1))  # the packed layout is [in, out]
        shifted = (rows_int + zero_point).to(torch.uint8)
        return torch.ops.onednn.qlinear_pointwise(shifted, 1.0, zero_point, packed_weight, unit_scales, zero_points,
                                                  None, 1.0, 0, torch.float32, "none", [], "")

    return matmul


@functools.lru_cache(maxsize=64)
def _unit_scales(out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(out_features), torch.zeros(out_features, dtype=torch.int64)


def _onednn_prepack(weight_int8: torch.Tensor) -> torch.Tensor:  # [out, in] int8 -> oneDNN's blocked layout
    return torch.ops.onednn.qlinear_prepack(weight_int8, None)


INT_MM = Int8Kernel("int_mm-8bit", 127, lambda weight: weight, _int_mm, "torch._int_mm, 8-bit activations")
PACKED_8_BIT = Int8Kernel("onednn-packed-8bit", 127, _onednn_prepack, _onednn_packed(128),
                          "oneDNN packed u8 x s8, 8-bit activations")
PACKED_7_BIT = Int8Kernel("onednn-packed-7bit", 63, _onednn_prepack, _onednn_packed(64),
                          "oneDNN packed u8 x s8, 7-bit activations")
# The order breaks timing ties: 8-bit first, the kernel that needs no oneDNN op last.
CANDIDATES: list[Int8Kernel] = [PACKED_8_BIT, PACKED_7_BIT, INT_MM]


@dataclass(frozen=True)
class KernelChoice:
    kernel: Int8Kernel
    refused: dict[str, str]  # candidate name -> why it is not used (wrong results, or slower)
    milliseconds: dict[str, float]  # candidate name -> measured time of a 1-row plus an 8-row call


def check_kernel(kernel: Int8Kernel, out_features: int, in_features: int, seed: int = 0) -> str | None:
    """None if `kernel` returns the exact integer products for this shape, on saturation-prone
    and random inputs, with every row of a block equal to that row alone; else what went wrong.
    Output channels are capped at CHECK_MAX_OUT: each is computed alike, and a vocabulary-sized
    head would make the check slow."""
    out_features = min(out_features, CHECK_MAX_OUT)
    generator = torch.Generator().manual_seed(seed)
    amax = kernel.activation_max
    signs = torch.randint(0, 2, (out_features, in_features), generator=generator, dtype=torch.int8) * 2 - 1
    weight = signs * 127  # [out, in] int8, every weight at +-127 ...
    half = out_features // 2  # ... in the first half of the channels, random in the second
    weight[half:] = torch.randint(-127, 128, (out_features - half, in_features), generator=generator, dtype=torch.int8)
    try:
        stored = kernel.prepare(weight)
    except (RuntimeError, AttributeError) as error:
        return f"unavailable ({type(error).__name__})"
    for rows in CHECK_ROWS:
        activations = torch.randint(-amax, amax + 1, (rows, in_features), generator=generator).float()
        activations[0] = amax  # every pair of products at its largest
        if rows > 1:
            activations[1] = -amax
        if rows > 2:  # each product at +amax * 127: channel 0's signs
            activations[2] = amax * signs[0].float()
        exact = (activations.double() @ weight.double().t()).float()  # [rows, out] exact, then one rounding
        try:
            product = kernel.matmul(activations, stored)
        except RuntimeError as error:
            return f"unavailable ({type(error).__name__})"
        if not torch.equal(product, exact):
            wrong = (product.double() - exact.double()).abs().max().item()
            return f"wrong products for {rows}-row blocks (off by up to {wrong:.3g})"
        alone = torch.cat([kernel.matmul(activations[row:row + 1], stored) for row in range(rows)])
        if not torch.equal(alone, product):
            return f"rows of a {rows}-row block differ from the same rows alone"
    return None


def time_kernel(kernel: Int8Kernel, out_features: int, in_features: int) -> float:
    """Milliseconds of a 1-row plus an 8-row call (decode and a verify block), best of a few
    (inf if the kernel cannot run)."""
    weight = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
    total = 0.0
    try:
        stored = kernel.prepare(weight)
        for rows in (1, 8):
            activations = torch.randint(-kernel.activation_max, kernel.activation_max + 1, (rows, in_features)).float()
            kernel.matmul(activations, stored)  # warm-up
            best = float("inf")
            deadline = time.perf_counter() + 0.05
            for _ in range(10):
                start = time.perf_counter()
                kernel.matmul(activations, stored)
                best = min(best, time.perf_counter() - start)
                if time.perf_counter() > deadline:
                    break
            total += best * 1000
    except (RuntimeError, AttributeError):
        return float("inf")
    return total


def choose(out_features: int, in_features: int, candidates: list[Int8Kernel] | None = None) -> KernelChoice:
    """Time every candidate on this shape, then check them, fastest first, until the rest could
    not be chosen anyway; pick the fastest exact one, 8-bit activations while within
    PREFER_8_BIT_WITHIN of it (see the module doc)."""
    candidates = candidates or CANDIDATES
    timings = {kernel.name: time_kernel(kernel, out_features, in_features) for kernel in candidates}
    refused: dict[str, str] = {}
    exact: list[Int8Kernel] = []
    for kernel in sorted(candidates, key=lambda kernel: timings[kernel.name]):
        if exact and timings[kernel.name] > PREFER_8_BIT_WITHIN * timings[exact[0].name]:
            refused[kernel.name] = f"not checked: {_ratio(timings, kernel, exact[0])} the time"
            continue
        problem = check_kernel(kernel, out_features, in_features)
        if problem:
            refused[kernel.name] = problem
        else:
            exact.append(kernel)
    if not exact:
        raise RuntimeError(f"no int8 kernel is exact on this machine for a {out_features}x{in_features} weight "
                           f"({'; '.join(f'{n}: {r}' for n, r in refused.items())}); load without --quantize int8")
    eight_bit = [kernel for kernel in exact if kernel.activation_max == 127]
    chosen = eight_bit[0] if eight_bit else exact[0]
    for kernel in exact:
        if kernel is not chosen:
            refused[kernel.name] = f"exact, {_ratio(timings, kernel, chosen)} the time"
    return KernelChoice(chosen, refused, {name: round(ms, 4) for name, ms in timings.items()})


def _ratio(timings: dict[str, float], kernel: Int8Kernel, reference: Int8Kernel) -> str:
    return f"{timings[kernel.name] / timings[reference.name]:.1f}x"


class KernelCache:
    """Choices by weight shape: in memory for this process, and in a JSON file in the cache
    folder per machine for every later one (file_name None: this process only)."""

    def __init__(self, file_name: str | None = "int8-kernels.json") -> None:
        self.file_name = file_name
        self.choices: dict[tuple[int, int], KernelChoice] = {}
        self.on_check: Callable[[str], None] | None = None  # progress: told before each shape is checked

    def get(self, out_features: int, in_features: int) -> KernelChoice:
        shape = (out_features, in_features)
        if shape not in self.choices:
            if self.file_name is None:
                stored = self._check(shape)
            else:
                stored = cached_measurement(cache_root() / self.file_name, f"{out_features}x{in_features}",
                                            lambda: self._check(shape))
            by_name = {kernel.name: kernel for kernel in CANDIDATES}
            if stored["kernel"] not in by_name:  # a candidate this version no longer has
                stored = self._check(shape)
            self.choices[shape] = KernelChoice(by_name[stored["kernel"]], stored["refused"], stored["milliseconds"])
        return self.choices[shape]

    def _check(self, shape: tuple[int, int]) -> dict:
        if self.on_check:
            self.on_check(f"checking int8 kernels for a {shape[0]}x{shape[1]} weight on this CPU (once per machine)")
        choice = choose(*shape)
        return {"kernel": choice.kernel.name, "refused": choice.refused, "milliseconds": choice.milliseconds}
