"""8-bit weight groups with float32 activations (`--quantize w8a32`): a 4- or 8-bit GGUF computed
as float32 computes it, at a fraction of float32's exact blocks' cost (measured: docs/design.md,
"Correct and fast on every CPU").

Why: int8 and int4 round each activation row to 8 bits, so a quantized model's greedy text drifts
from its float32 text in near-ties (measured on the default SmolLM2-135M, a Q4_1 GGUF dequantized
to float32: 0 of 9 texts equal, first differences at tokens 0-39). Here a weight is
scale * q + min per group of 32 inputs (q int8; scale and min float32, per output and group), which
holds Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K weights exactly, and activations stay float32:
the product differs from float32's only in the order of its float sums (kernels/w8a32_matmul.cpp
has the formula). Weights that are not such groups (Q6_K's 16-input sub-blocks, float checkpoints)
get the closest 8-bit groups: a quantization then, and the notice line counts the groups held.

Each row is computed by the same instructions alone or in a block, so a token scores the same
inside a verify block as alone. The kernel is compiled into one library with the int4 kernel
(specdec/models/native.py) and checked at load on every weight shape (check_kernel, cached per
machine): within float32 rounding of a float64 product and row-invariant; where it is not, int8
runs, with a notice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import specdec.models.native as native
from specdec.models.int4 import COLS, GROUP, PackedLinear
from specdec.models.native import KernelUnavailable

RECORD = 640  # bytes per (16 outputs, 32 inputs): 512 int8 q, 16 float32 scales, 16 float32 mins
CHUNK = 2048  # output rows packed at a time: the candidate forms of a 150k-row head would not fit memory


Form = tuple[torch.Tensor, torch.Tensor, int, int]  # (scale [m], min [m], q_low, q_high) for m groups


def _gap_steps(groups: torch.Tensor) -> Form:
    """Steps of the smallest gap between a group's values (1 for a constant group), from its least."""
    gaps = groups.sort(-1).values.diff(dim=-1)
    smallest = torch.where(gaps > 0, gaps, torch.inf).amin(-1)
    return torch.where(torch.isfinite(smallest), smallest, 1.0), groups.amin(-1), 0, 127


def _eight_bit(groups: torch.Tensor) -> Form:
    scale = (groups.amax(-1) - groups.amin(-1)) / 255
    return scale, groups.amin(-1) + 128 * scale, -128, 127


# The forms a GGUF's blocks take, tried in this order on the groups no earlier form held exactly
# (the first of equally good forms wins): Q4_1 and Q5_1 as levels from the group's least value;
# Q8_0, Q4_0 and Q5_0 symmetric; Q4_K and Q5_K sub-blocks, whose levels need not span 0..15, as steps
# of the smallest gap between the group's values; and a general 8-bit one.
FORMS: list[Callable[[torch.Tensor], Form]] = [
    lambda groups: ((groups.amax(-1) - groups.amin(-1)) / 15, groups.amin(-1), 0, 15),
    lambda groups: (groups.abs().amax(-1) / 127, torch.zeros(groups.shape[0]), -127, 127),
    lambda groups: (groups.abs().amax(-1) / 8, torch.zeros(groups.shape[0]), -8, 8),
    lambda groups: (groups.abs().amax(-1) / 16, torch.zeros(groups.shape[0]), -16, 16),
    lambda groups: ((groups.amax(-1) - groups.amin(-1)) / 31, groups.amin(-1), 0, 31),
    _gap_steps,
    _eight_bit,
]


def _best_form(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """groups [m, 32] -> (scale [m], min [m], q [m, 32], exact [m]): per group the first form that
    holds it exactly, else the one with the least largest error. Later forms run only on the groups
    still open: a GGUF's matrix is usually done after one or two."""
    count = groups.shape[0]
    scale, minimum = torch.ones(count), torch.zeros(count)
    q, error = torch.zeros(count, GROUP), torch.full((count,), torch.inf)
    open_groups = torch.arange(count)
    for form in FORMS:
        if form is _gap_steps and not bool((error == 0).any()):
            continue  # a float matrix (no group held so far) is never steps of one gap; its sort is costly
        subset = groups[open_groups]
        form_scale, form_min, q_low, q_high = form(subset)
        form_scale = torch.where(form_scale > 0, form_scale, 1.0)
        form_q = torch.round((subset - form_min[:, None]) / form_scale[:, None]).clamp(q_low, q_high)
        form_error = (form_q * form_scale[:, None] + form_min[:, None] - subset).abs().amax(-1)
        better = form_error < error[open_groups]
        chosen = open_groups[better]
        scale[chosen], minimum[chosen], q[chosen], error[chosen] = (
            form_scale[better], form_min[better], form_q[better], form_error[better])
        open_groups = open_groups[error[open_groups] > 0]
        if open_groups.numel() == 0:
            break
    return scale, minimum, q, error == 0


@dataclass(frozen=True)
class Packed:
    """A weight in the kernel's records, and what they hold."""

    records: torch.Tensor  # [blocks, groups, 640] uint8
    q: torch.Tensor  # [out_padded, in] int8
    scale: torch.Tensor  # [out_padded, in / 32] float32
    minimum: torch.Tensor  # [out_padded, in / 32] float32
    exact: torch.Tensor  # [out_padded, in / 32] bool: scale * q + min gives the group's weights exactly


def pack_weight(weight: torch.Tensor) -> Packed:
    """weight [out, in] (in a multiple of 32) -> its records. Outputs are padded to a multiple of
    16 with zero weights. (q in nibbles for a Q4_1 GGUF's weights, 6 bits a weight instead of 10,
    was measured and dropped: no faster, since the kernel is bound by decoding q, not by reading it;
    docs/design.md, "Correct and fast on every CPU".)"""
    out_features, in_features = weight.shape
    padded, groups = -(-out_features // COLS) * COLS, in_features // GROUP
    q = torch.zeros(padded, groups, GROUP, dtype=torch.int8)
    scale, minimum = torch.ones(padded, groups), torch.zeros(padded, groups)
    exact = torch.ones(padded, groups, dtype=torch.bool)
    for start in range(0, out_features, CHUNK):
        rows = weight[start:start + CHUNK].detach().float()
        stop = start + rows.shape[0]
        chunk_scale, chunk_min, chunk_q, chunk_exact = _best_form(rows.reshape(-1, GROUP))
        scale[start:stop], minimum[start:stop] = chunk_scale.view(-1, groups), chunk_min.view(-1, groups)
        exact[start:stop], q[start:stop] = chunk_exact.view(-1, groups), chunk_q.view(-1, groups, GROUP).to(torch.int8)
    blocks = padded // COLS
    # q [blocks, 16 cols, groups, 32 inputs] -> [blocks, groups, inputs, cols]
    q_bytes = q.reshape(blocks, COLS, groups, GROUP).permute(0, 2, 3, 1).reshape(blocks, groups, -1).view(torch.uint8)

    def per_record(values: torch.Tensor) -> torch.Tensor:  # [padded, groups] float32 -> [blocks, groups, 64] bytes
        return values.reshape(blocks, COLS, groups).transpose(1, 2).contiguous().view(torch.uint8)

    records = torch.cat([q_bytes, per_record(scale), per_record(minimum)], dim=2).contiguous()
    assert records.shape[2] == RECORD  # what w8a32_matmul.cpp reads
    return Packed(records, q.reshape(padded, in_features), scale, minimum, exact)


def dequantized(packed: Packed) -> torch.Tensor:
    """The weights the records hold, in float64: [out_padded, in]."""
    rows = packed.q.shape[0]
    grouped = packed.q.double().reshape(rows, -1, GROUP)
    return (grouped * packed.scale.double()[..., None] + packed.minimum.double()[..., None]).reshape(rows, -1)


def kernel_linear(rows: torch.Tensor, packed: Packed) -> torch.Tensor:
    """rows [M, K] float32 through the compiled kernel: [M, out_padded] float32."""
    return records_linear(rows, packed.records, packed.q.shape[0])


def records_linear(rows: torch.Tensor, records: torch.Tensor, out_padded: int) -> torch.Tensor:
    rows = rows.contiguous()
    output = torch.empty(rows.shape[0], out_padded)
    native.library().specdec_w8a32_linear(rows.data_ptr(), records.data_ptr(), output.data_ptr(), rows.shape[0],
                                          out_padded, rows.shape[1])
    return output


class W8A32Linear(PackedLinear):
    """W in 8-bit groups (module doc) and x in float32."""

    format = 8

    @classmethod
    def of(cls, linear: nn.Linear) -> W8A32Linear:
        packed = pack_weight(linear.weight)
        module = cls(packed.records, linear.in_features, linear.out_features, linear.bias)
        module.exact_groups = int(packed.exact[: linear.out_features].sum())  # the notice says how many
        return module

    def multiply(self, rows: torch.Tensor) -> torch.Tensor:
        return records_linear(rows, self.records, self.out_padded)


CHECK_ROWS = (1, 3, 8, 12, 40)  # one token, verify blocks (12: a whole AVX-512 tile), a prefill-sized call
CHECK_MAX_OUT = 1024
TOLERANCE = 2e-5  # of sum |x| |w| per output: float32 rounding of 32-term group sums and the sum over groups


def check_kernel(out_features: int, in_features: int, seed: int = 0,
                 linear: Callable[[torch.Tensor, Packed], torch.Tensor] | None = None) -> str | None:
    """None if the kernel's products are within float32 rounding of the float64 product for this
    shape, on 4-bit, 8-bit, general and extreme weights and activations, with every row of a block
    equal to that row alone; else what went wrong. `linear` replaces the kernel (tests inject a
    wrong one)."""
    linear = linear or kernel_linear
    out_features = min(-(-out_features // COLS) * COLS, CHECK_MAX_OUT)
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    levels = torch.randint(0, 16, (out_features, in_features), generator=generator).float()
    weight[1::4] = torch.randint(-127, 128, weight[1::4].shape, generator=generator).float() * 0.01  # Q8_0-like
    weight[2::4, ::3] *= 1e3  # large next to small
    levels[:, 0::GROUP], levels[:, 1::GROUP] = 0, 15  # every group spans its 16 levels
    exponents = torch.randint(-4, 4, (out_features, in_features // GROUP), generator=generator)
    four_bit = (levels * 0.0625 - 0.5) * torch.exp2(exponents.float()).repeat_interleave(GROUP, 1)  # Q4_1-like
    try:
        cases = {"8-bit": pack_weight(weight), "4-bit": pack_weight(four_bit)}
    except RuntimeError as error:
        return f"unavailable ({type(error).__name__})"
    for rows in CHECK_ROWS:
        activations = torch.randn(rows, in_features, generator=generator)
        activations[0] = 1.0
        if rows > 1:
            activations[1, ::2] = 1e4  # a wide range within one row
            activations[1, 1::2] = -1e-4
        for name, packed in cases.items():
            try:
                product = linear(activations, packed)
            except (RuntimeError, OSError, KernelUnavailable) as error:
                return f"unavailable ({error})"
            weights = dequantized(packed)
            expected = activations.double() @ weights.T
            bound = TOLERANCE * (activations.double().abs() @ weights.abs().T) + 1e-30
            off = ((product.double() - expected).abs() / bound).max().item()
            if not off <= 1:
                return f"wrong results for {rows}-row blocks of {name} weights ({off:.3g} times float32 rounding)"
            alone = torch.cat([linear(activations[row:row + 1], packed) for row in range(rows)])
            if not torch.equal(alone, product):
                return f"rows of a {rows}-row block of {name} weights differ from the same rows alone"
    return None


def kernel_isa() -> str:
    return native.library().specdec_w8a32_isa().decode()
