"""8-bit weight groups with float32 activations (`--quantize w8a32`): a 4- or 8-bit GGUF computed
as float32 computes it, at the speed of its bytes.

Why: int8 and int4 round each activation row to 8 bits, so a quantized model's greedy text drifts
from its float32 text in near-ties (measured on the default SmolLM2-135M, a Q4_1 GGUF dequantized
to float32: 0 of 9 texts equal, first differences at tokens 0-39). Here a weight is
scale * q + min per group of 32 inputs (q int8; scale and min float32, per output and group), which
holds Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 weights exactly, and activations stay float32: the product differs from
float32's only in the order of its float sums (kernels/w8a32_matmul.cpp has the formula). Weights
that are not 4- or 8-bit groups get the closest such groups (8-bit, a quantization then).

Each row is computed by the same instructions alone or in a block, so a token scores the same
inside a verify block as alone. The kernel is compiled with the int4 kernel (specdec/models/int4.py)
and checked at load on every weight shape (check_kernel, cached per machine): within float32
rounding of a float64 product and row-invariant; where it is not, int8 runs, with a notice.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from specdec.models.int4 import COLS, GROUP, KernelUnavailable, PackedLinear, checked_shapes, compiled_kernel

RECORD = 640  # bytes per (16 outputs, 32 inputs): 512 int8 q, 16 float32 scales, 16 float32 mins


CHUNK = 2048  # output rows packed at a time: the candidate forms of a 150k-row head would not fit memory


def _candidates(grouped: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, int, int]]:
    """(scale, min, q_low, q_high) per group [rows, groups] for grouped [rows, groups, 32]: the
    forms a GGUF's blocks take (Q8_0, Q4_0 and Q5_0 symmetric; Q4_1 and Q5_1 as levels from the
    group's least value) and a general 8-bit one."""
    low, high = grouped.amin(-1), grouped.amax(-1)
    largest = grouped.abs().amax(-1)
    zero = torch.zeros_like(low)
    eight_bit_scale = (high - low) / 255
    return [
        (largest / 127, zero, -127, 127),
        (largest / 8, zero, -8, 8),
        (largest / 16, zero, -16, 16),
        ((high - low) / 15, low, 0, 15),
        ((high - low) / 31, low, 0, 31),
        (eight_bit_scale, low + 128 * eight_bit_scale, -128, 127),
    ]


def _best_form(grouped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale, min [rows, groups], q [rows, groups, 32], exact [rows, groups]): per group the form
    with the least largest error, the first of equals."""
    best: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    for scale, minimum, q_low, q_high in _candidates(grouped):
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round((grouped - minimum[..., None]) / scale[..., None]).clamp(q_low, q_high)
        error = (q * scale[..., None] + minimum[..., None] - grouped).abs().amax(-1)
        if best is None:
            best = (scale, minimum, q, error)
            continue
        better = error < best[3]
        best = (torch.where(better, scale, best[0]), torch.where(better, minimum, best[1]),
                torch.where(better[..., None], q, best[2]), torch.minimum(error, best[3]))
    assert best is not None
    return best[0], best[1], best[2], best[3] == 0


def pack_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] (in a multiple of 32) -> (records [blocks, groups, 640] uint8, q [out_padded,
    in] int8, scale and min [out_padded, in / 32] float32, exact [out_padded, in / 32] bool: whether
    scale * q + min gives the group's weights exactly). Outputs are padded to a multiple of 16
    with zero weights."""
    out_features, in_features = weight.shape
    padded, groups = -(-out_features // COLS) * COLS, in_features // GROUP
    q = torch.zeros(padded, groups, GROUP, dtype=torch.int8)
    scale, minimum = torch.ones(padded, groups), torch.zeros(padded, groups)
    exact = torch.ones(padded, groups, dtype=torch.bool)
    for start in range(0, out_features, CHUNK):
        rows = weight[start:start + CHUNK].detach().float().reshape(-1, groups, GROUP)
        chunk_scale, chunk_min, chunk_q, chunk_exact = _best_form(rows)
        stop = start + rows.shape[0]
        scale[start:stop], minimum[start:stop], exact[start:stop] = chunk_scale, chunk_min, chunk_exact
        q[start:stop] = chunk_q.to(torch.int8)
    blocks = padded // COLS
    # q [blocks, 16 cols, groups, 32 inputs] -> [blocks, groups, inputs, cols]
    q_bytes = q.reshape(blocks, COLS, groups, GROUP).permute(0, 2, 3, 1).reshape(blocks, groups, GROUP * COLS)

    def per_record(values: torch.Tensor) -> torch.Tensor:  # [padded, groups] float32 -> [blocks, groups, 64] bytes
        return values.reshape(blocks, COLS, groups).transpose(1, 2).contiguous().view(torch.uint8)

    records = torch.cat([q_bytes.view(torch.uint8), per_record(scale), per_record(minimum)], dim=2).contiguous()
    return records, q.reshape(padded, in_features), scale, minimum, exact


def dequantized(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The weights the records hold, in float64: [out_padded, in]."""
    rows = q.shape[0]
    return (q.double().reshape(rows, -1, GROUP) * scale.double()[..., None] + minimum.double()[..., None]).reshape(
        rows, -1)


def kernel_linear(rows: torch.Tensor, records: torch.Tensor, out_padded: int) -> torch.Tensor:
    """rows [M, K] float32 through the compiled kernel: [M, out_padded] float32."""
    rows = rows.contiguous()
    output = torch.empty(rows.shape[0], out_padded)
    compiled_kernel().specdec_w8a32_linear(rows.data_ptr(), records.data_ptr(), output.data_ptr(), rows.shape[0],
                                           out_padded, rows.shape[1])
    return output


class W8A32Linear(PackedLinear):
    """W in 8-bit groups (module doc) and x in float32."""

    format = 8

    def __init__(self, linear: nn.Linear) -> None:
        records, q, _, _, exact = pack_weight(linear.weight)
        super().__init__(linear, records, q.shape[0])
        self.exact_groups = int(exact[: linear.out_features].sum())  # groups held exactly (the notice counts them)

    def multiply(self, rows: torch.Tensor) -> torch.Tensor:
        return kernel_linear(rows, self.records, self.out_padded)


CHECK_ROWS = (1, 3, 8, 40)  # one token, verify blocks, a prefill-sized call
CHECK_MAX_OUT = 1024
TOLERANCE = 2e-5  # of sum |x| |w| per output: float32 rounding of 32-term group sums and the sum over groups


def check_kernel(out_features: int, in_features: int, seed: int = 0,
                 linear: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None) -> str | None:
    """None if the kernel's products are within float32 rounding of the float64 product for this
    shape, on 4-bit, 8-bit, general and extreme weights and activations, with every row of a block
    equal to that row alone; else what went wrong. `linear` replaces the kernel (tests inject a
    wrong one)."""
    linear = linear or kernel_linear
    out_features = min(-(-out_features // COLS) * COLS, CHECK_MAX_OUT)
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    levels = torch.randint(0, 16, (out_features, in_features), generator=generator).float()
    weight[0::4] = levels[0::4] * 0.0625 - 0.5  # Q4_1-like groups
    weight[1::4] = torch.randint(-127, 128, weight[1::4].shape, generator=generator).float() * 0.01  # Q8_0-like
    weight[2::4, ::3] *= 1e3  # large next to small
    try:
        records, q, scale, minimum, _ = pack_weight(weight)
    except RuntimeError as error:
        return f"unavailable ({type(error).__name__})"
    weights = dequantized(q, scale, minimum)
    for rows in CHECK_ROWS:
        activations = torch.randn(rows, in_features, generator=generator)
        activations[0] = 1.0
        if rows > 1:
            activations[1, ::2] = 1e4  # a wide range within one row
            activations[1, 1::2] = -1e-4
        try:
            product = linear(activations, records, out_features)
        except (RuntimeError, OSError, KernelUnavailable) as error:
            return f"unavailable ({error})"
        expected = activations.double() @ weights.T
        bound = TOLERANCE * (activations.double().abs() @ weights.abs().T) + 1e-30
        off = ((product.double() - expected).abs() / bound).max().item()
        if not off <= 1:
            return f"wrong results for {rows}-row blocks ({off:.3g} times float32 rounding)"
        alone = torch.cat([linear(activations[row:row + 1], records, out_features) for row in range(rows)])
        if not torch.equal(alone, product):
            return f"rows of a {rows}-row block differ from the same rows alone"
    return None


def kernel_isa() -> str:
    return compiled_kernel().specdec_w8a32_isa().decode()


def quantize_w8a32(module: nn.Module) -> nn.Module:
    """Replace every nn.Linear whose input size fits with a W8A32Linear (the rest, and every one if
    the kernel cannot run here, with an Int8Linear), in place. `module.quantized` says which ran
    and `module.quantize_notice` is the one line the CLI prints about it."""
    from specdec.models.quantize import KERNELS, Int8Linear

    if next(module.parameters()).device.type != "cpu":
        raise ValueError("w8a32 runs on CPU only; use --device cpu or drop --quantize")
    module.float()
    linears = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    shapes = {(child.out_features, child.in_features) for _, _, child in linears if W8A32Linear.fits(child)}
    problem = checked_shapes(shapes, KERNELS.on_check, check_kernel, "w8a32")
    packed = []
    for parent, name, child in linears:
        replacement = W8A32Linear(child) if problem is None and W8A32Linear.fits(child) else Int8Linear(child)
        setattr(parent, name, replacement)
        packed += [replacement] if isinstance(replacement, W8A32Linear) else []
    groups = sum(linear.out_features * linear.in_features // GROUP for linear in packed)
    exact = sum(linear.exact_groups for linear in packed)
    others = len(linears) - len(packed)
    notice = (f"w8a32 kernel not used ({problem}): int8 weights instead" if problem else
              f"w8a32 kernel on this CPU: {kernel_isa()}, float32 activations, checked on {len(shapes)} weight "
              f"shapes; {exact / max(groups, 1):.1%} of weight groups held exactly (4- or 8-bit groups)"
              + (f"; {others} linears with inputs not a multiple of {GROUP} are int8" if others else ""))
    setattr(module, "quantized", "int8" if problem else "w8a32")  # what LanguageModel.precision reports
    setattr(module, "quantize_notice", notice)  # the one line the CLI prints
    return module
