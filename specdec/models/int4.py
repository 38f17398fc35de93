"""4-bit weights on CPU, batch-invariant: Int4Linear and the compiled kernel it runs on.

Why: decoding one token streams every weight once, so the weights' bytes set the speed of a
one-token forward on a CPU (the 1.5B target's int8 linears take ~80% of its step). 4-bit groups
halve them, the precision llama.cpp users run (Q4_K_M); torch's own int4 kernel
(`_weight_int4pack_mm_for_cpu`) is fast for one row but compute-bound from two (measured with
benchmarks/cpu/int4_kernels.py; docs/design.md, "Correct and fast on every CPU"), which
would make verify blocks expensive.

The scheme: weights in groups of 32 inputs, w ~ scale * q + min with q in 0..15 (scale and min in
float16, per output and group: 5 bits a weight); activations per row as in int8 (round(x / sx),
|x| <= 127); the integer dot product of each group is exact (u8 x s8 products, which even AVX2's
saturating int16 pair sums hold: 15 x 127 x 2), and the float sum over groups runs in one fixed
order per row (specdec/models/kernels/int4_matmul.cpp has the formula). So a row's result is the
same whatever else is in the call: the greedy-equality invariant holds as in int8.

The kernel is C++ (kernels/int4_matmul.cpp) in the library specdec/models/native.py compiles on
first use for this CPU (`g++ -march=native`: AVX-512 VNNI, AVX2 or portable code), checked bit for
bit against `reference_matmul` on every weight shape before it runs (check_kernel, cached per
machine and library); a machine without a compiler, or where the check fails, gets int8 instead,
with a one-line notice saying why.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import specdec.models.native as native
from specdec.models.native import KernelUnavailable

GROUP = 32  # inputs per scale
COLS = 16  # outputs per block of the packed layout
PACK_ROWS = 4096  # outputs packed at a time (a multiple of COLS)


def pack_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] (in a multiple of 32) -> (packed records, q [out_padded, in] uint8,
    scale and min [out_padded, in / 32] float32 as the kernel reads them). Outputs are padded to a
    multiple of 16 with zero weights."""
    out_features, in_features = weight.shape
    padded = -(-out_features // COLS) * COLS
    groups = in_features // GROUP
    grouped = torch.zeros(padded, groups, GROUP)
    grouped[:out_features] = weight.detach().float().reshape(out_features, groups, GROUP)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scale_half = ((high - low) / 15).to(torch.float16)
    min_half = low.to(torch.float16)
    scale, minimum = scale_half.float(), min_half.float()  # what the kernel multiplies with
    safe_scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((grouped - minimum[..., None]) / safe_scale[..., None]).clamp(0, 15).to(torch.uint8)
    q = q.reshape(padded, in_features)
    return _records(q, scale_half, min_half), q, scale, minimum


def _records(q: torch.Tensor, scale_half: torch.Tensor, min_half: torch.Tensor) -> torch.Tensor:
    padded, in_features = q.shape
    blocks, groups = padded // COLS, in_features // GROUP
    # q [blocks, 16 cols, groups, 4 steps, 2 nibbles, 4 inputs] -> [blocks, groups, steps, cols, inputs]
    q = q.reshape(blocks, COLS, groups, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)
    nibbles = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # [blocks, groups, steps, cols, inputs]
    nibbles = nibbles.reshape(blocks, groups, 256)
    scales = scale_half.reshape(blocks, COLS, groups).transpose(1, 2).contiguous().view(torch.uint8)
    mins = min_half.reshape(blocks, COLS, groups).transpose(1, 2).contiguous().view(torch.uint8)
    return torch.cat([nibbles, scales, mins], dim=2).contiguous()  # [blocks, groups, 320]


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rows [M, K] float32 -> (int8 [M, K], per-group sums [M, K / 32] float32, scale [M])."""
    row_scale = rows.abs().amax(dim=1).clamp(min=1e-12) / 127
    rows_int = torch.round(rows / row_scale[:, None]).to(torch.int8)
    sums = rows_int.reshape(rows.shape[0], -1, GROUP).sum(-1, dtype=torch.int32).float()
    return rows_int, sums, row_scale


def kernel_linear(rows: torch.Tensor, records: torch.Tensor, out_padded: int) -> torch.Tensor:
    """rows [M, K] float32 through the compiled kernel, activations quantized inside it exactly as
    quantize_rows does: [M, out_padded] float32."""
    rows = rows.contiguous()
    output = torch.empty(rows.shape[0], out_padded)
    native.library().specdec_int4_linear(rows.data_ptr(), records.data_ptr(), output.data_ptr(), rows.shape[0],
                                         out_padded, rows.shape[1])
    return output


def reference_matmul(rows_int: torch.Tensor, sums: torch.Tensor, row_scale: torch.Tensor, q: torch.Tensor,
                     scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The kernel's formula in torch, operation for operation (exact integer dots, then float32
    multiplies and adds in the kernel's order): what the kernel must return bit for bit."""
    rows, in_features = rows_int.shape
    groups = in_features // GROUP
    dots = torch.einsum("mgk,ngk->mng", rows_int.double().reshape(rows, groups, GROUP),
                        q.double().reshape(-1, groups, GROUP)).float()  # exact: |dot| < 2^24
    accumulated = torch.zeros(rows, q.shape[0])
    for group in range(groups):
        p1 = dots[:, :, group] * scale[:, group]
        p2 = minimum[:, group] * sums[:, group:group + 1]
        accumulated = accumulated + (p1 + p2)
    return accumulated * row_scale[:, None]


class PackedLinear(nn.Module):
    """y = x @ W^T + b on a compiled kernel reading W from packed records (Int4Linear, and
    W8A32Linear in specdec/models/w8a32.py), outputs padded to a multiple of 16. Built only for
    weights whose input size is a multiple of 32 (`fits`)."""

    records: torch.Tensor  # [blocks, groups, record bytes] uint8, the kernel's layout
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
        records = torch.cat([pack_weight(linear.weight[start:start + PACK_ROWS])[0]
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
    try:
        records, q, scale, minimum = pack_weight(weight)
    except RuntimeError as error:
        return f"unavailable ({type(error).__name__})"
    for rows in CHECK_ROWS:
        activations = torch.randn(rows, in_features, generator=generator)
        activations[0] = 1.0  # every activation at +127 against every weight at 15
        if rows > 1:
            activations[1] = -1.0
        if rows > 2:
            activations[2, ::2] = 1e-3  # small values next to the row's largest
        expected = reference_matmul(*quantize_rows(activations), q, scale, minimum)
        try:
            product = linear(activations, records, out_features)
        except (RuntimeError, OSError, KernelUnavailable) as error:
            return f"unavailable ({error})"
        if not torch.equal(product, expected):
            wrong = (product.double() - expected.double()).abs().max().item()
            return f"wrong results for {rows}-row blocks (off by up to {wrong:.3g})"
        alone = torch.cat([linear(activations[row:row + 1], records, out_features) for row in range(rows)])
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
