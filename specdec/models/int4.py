"""4-bit weights on CPU, batch-invariant: Int4Linear and the compiled kernel it runs on.

Why: decoding one token streams every weight once, so the weights' bytes set the speed of a
one-token forward on a CPU (the 1.5B target's int8 linears take ~80% of its step). 4-bit groups
halve them, the precision llama.cpp users run (Q4_K_M); torch's own int4 kernel
(`_weight_int4pack_mm_for_cpu`) is fast for one row but compute-bound from two (measured with
benchmarks/cpu/int4_kernels.py; docs/design.md, "Correct and fast on every CPU"), which
would make verify blocks expensive.

The scheme: weights in groups of 32 inputs, w ~ d * sc * q - dmin * mn with q in 0..15, each
group's scale sc and min mn 8-bit integers under a float16 d and dmin per super-block of 8 groups
(256 inputs), as llama.cpp's Q4_K nests its 6-bit ones: 4.625 bits a weight (it was 5, a float16
scale and min per group; a one-token forward streams every weight, so its time follows). Activations
per row as in int8 (round(x / sx), |x| <= 127); each group's integer dot product is exact (u8 x s8
products, which even AVX2's saturating int16 pair sums hold: 15 x 127 x 2), as are the super-block's
sums of sc x dot and mn x the activations' group sums, and the float sum over super-blocks runs in
one fixed order per row (specdec/models/kernels/int4_matmul.cpp has the formula). So a row's result
is the same whatever else is in the call: the greedy-equality invariant holds as in int8.

The kernel is C++ (kernels/int4_matmul.cpp) in the library specdec/models/native.py compiles on
first use for this CPU (`g++ -march=native`: AVX-512 VNNI, AVX2 or portable code), checked bit for
bit against `reference_matmul` on every weight shape before it runs (check_kernel, cached per
machine and library); a machine without a compiler, or where the check fails, gets int8 instead,
with a one-line notice saying why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import specdec.models.native as native
from specdec.models.native import KernelUnavailable

GROUP = 32  # inputs per sub-scale and sub-min
SUPER = 8  # groups per float16 scale and min scale (the last super-block of a row may be shorter)
COLS = 16  # outputs per block of the packed layout
PACK_ROWS = 4096  # outputs packed at a time (a multiple of COLS)


@dataclass(frozen=True)
class Packed:
    """A weight in the kernel's layout and, for the reference and the tests, its parts."""

    records: torch.Tensor  # [blocks, block bytes] uint8: what the kernel reads (int4_matmul.cpp)
    q: torch.Tensor  # [out_padded, in] uint8 codes 0..15
    sub_scales: torch.Tensor  # [out_padded, in / 32] uint8 (sc)
    sub_mins: torch.Tensor  # [out_padded, in / 32] uint8 (mn)
    scale: torch.Tensor  # [out_padded, super-blocks] float32, float16 values (d)
    min_scale: torch.Tensor  # [out_padded, super-blocks] float32, float16 values (dmin)

    def dequantized(self) -> torch.Tensor:  # [out_padded, in] float32: d * sc * q - dmin * mn
        padded, in_features = self.q.shape
        group_scale = self.sub_scales.float() * self.scale.repeat_interleave(SUPER, dim=1)[:, :in_features // GROUP]
        group_min = self.sub_mins.float() * self.min_scale.repeat_interleave(SUPER, dim=1)[:, :in_features // GROUP]
        grouped = self.q.float().reshape(padded, -1, GROUP) * group_scale[..., None] - group_min[..., None]
        return grouped.reshape(padded, in_features)


def _half_at_least(value: torch.Tensor) -> torch.Tensor:
    """``value`` [float32] as the nearest float16 not below it: a super-block's d (or dmin) then times
    255 reaches every group's scale (or min), so no code is clipped."""
    half = value.to(torch.float16)
    below = half.float() < value
    return torch.where(below, torch.nextafter(half, torch.tensor(float("inf"), dtype=torch.float16)), half)


def pack_weight(weight: torch.Tensor) -> Packed:
    """weight [out, in] (in a multiple of 32) -> its Packed records. Outputs are padded to a multiple
    of 16 with zero weights. Each group's range is widened to include 0 (its min at most 0, its max
    at least 0, as Q4_K's); its min and scale are rounded up to whole steps of the super-block's dmin
    and d, so the range still covers the group and no code clips."""
    out_features, in_features = weight.shape
    padded = -(-out_features // COLS) * COLS
    groups = in_features // GROUP
    supers = -(-groups // SUPER)
    grouped = torch.zeros(padded, groups, GROUP)
    grouped[:out_features] = weight.detach().float().reshape(out_features, groups, GROUP)

    def by_super(per_group: torch.Tensor) -> torch.Tensor:  # [padded, groups] -> [padded, supers, SUPER]
        return nn.functional.pad(per_group, (0, supers * SUPER - groups)).reshape(padded, supers, SUPER)

    below = by_super(-grouped.amin(-1).clamp(max=0.0))  # each group's -min, >= 0
    min_scale_half = _half_at_least(below.amax(-1) / 255)  # [padded, supers]
    min_scale = min_scale_half.float()
    sub_mins = torch.ceil(below / torch.where(min_scale > 0, min_scale, 1.0)[..., None]).clamp(0, 255)
    group_min = sub_mins * min_scale[..., None]  # >= -min
    needed = (by_super(grouped.amax(-1).clamp(min=0.0)) + group_min) / 15  # the step that reaches the max
    scale_half = _half_at_least(needed.amax(-1) / 255)
    scale = scale_half.float()
    sub_scales = torch.ceil(needed / torch.where(scale > 0, scale, 1.0)[..., None]).clamp(0, 255)

    def by_group(per_super: torch.Tensor) -> torch.Tensor:  # [padded, supers, SUPER] -> [padded, groups]
        return per_super.reshape(padded, supers * SUPER)[:, :groups]

    group_scale = by_group(sub_scales * scale[..., None])
    safe_scale = torch.where(group_scale > 0, group_scale, 1.0)
    q = torch.round((grouped + by_group(group_min)[..., None]) / safe_scale[..., None]).clamp(0, 15)
    q = q.to(torch.uint8).reshape(padded, in_features)
    sub_scales, sub_mins = by_group(sub_scales).to(torch.uint8), by_group(sub_mins).to(torch.uint8)
    records = _records(q, sub_scales, sub_mins, scale_half, min_scale_half)
    return Packed(records, q, sub_scales, sub_mins, scale, min_scale)


def _records(q: torch.Tensor, sub_scales: torch.Tensor, sub_mins: torch.Tensor, scale_half: torch.Tensor,
             min_scale_half: torch.Tensor) -> torch.Tensor:
    """The kernel's bytes [blocks, block bytes]: per super-block, each group's 256 bytes of codes,
    16 sub-scales and 16 sub-mins, then the 16 columns' d and dmin (int4_matmul.cpp)."""
    padded, in_features = q.shape
    blocks, groups = padded // COLS, in_features // GROUP
    # q [blocks, 16 cols, groups, 4 steps, 2 nibbles, 4 inputs] -> [blocks, groups, steps, cols, inputs]
    q = q.reshape(blocks, COLS, groups, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)
    nibbles = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(blocks, groups, 256)

    def by_block(per_column: torch.Tensor) -> torch.Tensor:  # [padded, n] -> [blocks, n, 16 cols]
        return per_column.reshape(blocks, COLS, -1).transpose(1, 2)

    per_group = torch.cat([nibbles, by_block(sub_scales), by_block(sub_mins)], dim=2)  # [blocks, groups, 288]
    tails = torch.cat([by_block(scale_half).contiguous().view(torch.uint8),
                       by_block(min_scale_half).contiguous().view(torch.uint8)], dim=2)  # [blocks, supers, 64]
    pieces = []
    for index, first in enumerate(range(0, groups, SUPER)):
        pieces += [per_group[:, first:first + SUPER].reshape(blocks, -1), tails[:, index]]
    return torch.cat(pieces, dim=1).contiguous()


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rows [M, K] float32 -> (int8 [M, K], per-group sums [M, K / 32] int32, scale [M])."""
    row_scale = rows.abs().amax(dim=1).clamp(min=1e-12) / 127
    rows_int = torch.round(rows / row_scale[:, None]).to(torch.int8)
    sums = rows_int.reshape(rows.shape[0], -1, GROUP).sum(-1, dtype=torch.int32)
    return rows_int, sums, row_scale


def kernel_linear(rows: torch.Tensor, records: torch.Tensor, out_padded: int) -> torch.Tensor:
    """rows [M, K] float32 through the compiled kernel, activations quantized inside it exactly as
    quantize_rows does: [M, out_padded] float32."""
    rows = rows.contiguous()
    output = torch.empty(rows.shape[0], out_padded)
    native.library().specdec_int4_linear(rows.data_ptr(), records.data_ptr(), output.data_ptr(), rows.shape[0],
                                         out_padded, rows.shape[1])
    return output


def reference_matmul(rows_int: torch.Tensor, sums: torch.Tensor, row_scale: torch.Tensor,
                     packed: Packed) -> torch.Tensor:
    """The kernel's formula in torch, operation for operation (exact integer sums per super-block,
    then float32 multiplies, subtractions and adds in the kernel's order): what the kernel must
    return bit for bit."""
    rows, in_features = rows_int.shape
    groups = in_features // GROUP
    dots = torch.einsum("mgk,ngk->mng", rows_int.double().reshape(rows, groups, GROUP),
                        packed.q.double().reshape(-1, groups, GROUP)).long()  # exact: |dot| < 2^16
    accumulated = torch.zeros(rows, packed.q.shape[0])
    for index, first in enumerate(range(0, groups, SUPER)):
        part = slice(first, first + SUPER)
        scaled = (dots[:, :, part] * packed.sub_scales[None, :, part].long()).sum(-1)  # [rows, out] exact
        mins = (sums[:, None, part].long() * packed.sub_mins[None, :, part].long()).sum(-1)
        products = scaled.float() * packed.scale[:, index], mins.float() * packed.min_scale[:, index]
        accumulated = accumulated + (products[0] - products[1])
    return accumulated * row_scale[:, None]


class PackedLinear(nn.Module):
    """y = x @ W^T + b on a compiled kernel reading W from packed records (Int4Linear, and
    W8A32Linear in specdec/models/w8a32.py), outputs padded to a multiple of 16. Built only for
    weights whose input size is a multiple of 32 (`fits`)."""

    records: torch.Tensor  # [blocks, ...] uint8, the kernel's layout (a column block of 16 outputs a row)
    format: int  # which packed layout the compiled layer calls read (kernels/layer_ops.cpp): 4 or 8

    def __init__(self, records: torch.Tensor, in_features: int, out_features: int,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("records", records)
        self.out_padded = records.shape[0] * COLS
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self.in_features, self.out_features = in_features, out_features
        self.exact_groups: int | None = None  # groups held exactly, where packing counted them (w8a32)

    @classmethod
    def of(cls, linear: nn.Linear) -> PackedLinear:
        """``linear`` packed (its weight read once; the packed module shares nothing with it)."""
        raise NotImplementedError

    @staticmethod
    def fits(linear: nn.Linear) -> bool:
        return linear.in_features % GROUP == 0

    def multiply(self, rows: torch.Tensor) -> torch.Tensor:  # [M, in] float32 -> [M, out_padded]
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] float32 -> [..., out]
        y = self.multiply(x.reshape(-1, self.in_features).float())
        if self.out_padded != self.out_features:
            y = y[:, :self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class Int4Linear(PackedLinear):
    """W in 4-bit groups and x in per-row int8 (module doc)."""

    format = 4

    @classmethod
    def of(cls, linear: nn.Linear) -> Int4Linear:
        # Rows in chunks: the packing's float32 temporaries stay small beside a vocabulary-sized head.
        records = torch.cat([pack_weight(linear.weight[start:start + PACK_ROWS]).records
                             for start in range(0, linear.out_features, PACK_ROWS)])
        return cls(records, linear.in_features, linear.out_features, linear.bias)

    def multiply(self, rows: torch.Tensor) -> torch.Tensor:
        return kernel_linear(rows, self.records, self.out_padded)


CHECK_ROWS = (1, 3, 8, 16, 40)  # one token, verify blocks (16: a whole tile), a prefill-sized call
CHECK_MAX_OUT = 1024


def check_kernel(out_features: int, in_features: int, seed: int = 0,
                 linear: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None) -> str | None:
    """None if the kernel returns reference_matmul's bits for this shape, on extreme and random
    weights and activations, with every row of a block equal to that row alone; else what went
    wrong. `linear` replaces the kernel (tests inject a wrong one)."""
    linear = linear or kernel_linear
    out_features = min(-(-out_features // COLS) * COLS, CHECK_MAX_OUT)
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    weight[0::4] = torch.where(weight[0::4] > 0, 1.0, -1.0)  # groups spanning +-1: q at 0 and 15
    weight[1::4] = torch.randint(0, 2, (1, in_features), generator=generator).float() * 15  # q 0 / 15, min 0
    weight[2::4] = 15.0  # q 15 but for each group's input 2 (q 0): a kernel's int16 lanes at their fullest
    weight[2::4, 2::32] = 0.0
    # groups whose ranges differ by up to 1000x within a super-block: sub-scales and sub-mins from 1 to 255
    spread = 10 ** -(3 * torch.rand(out_features // 4, in_features // GROUP, 1, generator=generator))
    weight[3::4] = (weight[3::4].reshape(out_features // 4, -1, GROUP) * spread).reshape(out_features // 4, -1)
    try:
        packed = pack_weight(weight)
    except RuntimeError as error:
        return f"unavailable ({type(error).__name__})"
    for rows in CHECK_ROWS:
        activations = torch.randn(rows, in_features, generator=generator)
        activations[0] = 1.0  # every activation at +127 against every weight at 15
        if rows > 1:
            activations[1] = -1.0
        if rows > 2:
            activations[2, ::2] = 1e-3  # small values next to the row's largest
        expected = reference_matmul(*quantize_rows(activations), packed)
        try:
            product = linear(activations, packed.records, out_features)
        except (RuntimeError, OSError, KernelUnavailable) as error:
            return f"unavailable ({error})"
        if not torch.equal(product, expected):
            wrong = (product.double() - expected.double()).abs().max().item()
            return f"wrong results for {rows}-row blocks (off by up to {wrong:.3g})"
        alone = torch.cat([linear(activations[row:row + 1], packed.records, out_features) for row in range(rows)])
        if not torch.equal(alone, product):
            return f"rows of a {rows}-row block differ from the same rows alone"
    return None


def checked_shapes(shapes: set[tuple[int, int]], on_check: Callable[[str], None] | None = None,
                   check: Callable[[int, int], str | None] | None = None, name: str = "int4") -> str | None:
    """None if the kernel library builds and the kernel passes ``check`` (default check_kernel) on
    every shape (cached per machine and library: native.cached_check), else why not. ``name`` is the
    kernel's, for the progress line and the cache key."""
    try:
        native.library()
    except KernelUnavailable as error:
        return str(error)
    check = check or check_kernel
    library = native.library_key()
    for out_features, in_features in sorted(shapes):
        def measure(out_features=out_features, in_features=in_features) -> str | None:
            if on_check:
                on_check(f"checking the {name} kernel for a {out_features}x{in_features} weight on this CPU (once)")
            return check(out_features, in_features)

        shape = f"{out_features}x{in_features}" + ("" if name == "int4" else f":{name}")
        problem = native.cached_check(library, shape, measure)
        if problem:
            return f"{out_features}x{in_features}: {problem}"
    return None


def kernel_isa() -> str:
    return native.library().specdec_int4_isa().decode()
