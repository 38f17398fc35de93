"""int8 weights on CPU, batch-invariant.

Decoding one token streams every weight once, so int8 weights are ~4x less memory traffic than
fp32 (measured once: 12.6 ms vs 57 ms per token for a 277M stack on a 2-core CPU).

Why not torch's `quantize_dynamic`: it quantizes the activations of a whole call with one
scale, so a row's result depends on the other rows in the block. The target would then score a
token differently inside a k-token verify block than alone, and speculative greedy output would
drift from target-only output (measured: 26 of 36 runs of a random 300M model differed).
Here every activation row gets its own scale and the int8 x int8 product accumulates exactly in
int32 (`torch._int_mm`), so each row's output is the same whatever else is in the block; the
lean model also attends one query row at a time after the prefill (LlamaFamilyModel.quantize_int8),
because int8 rounding turns SDPA's ~1e-7 block-vs-row differences into visible ones.

Kernel: oneDNN's u8 x s8 -> s32 matmul on weights packed once at load (`onednn.qlinear_prepack`,
the op torch's x86 inductor quantization uses), with scale 1 and zero point 128 so that it
returns the exact integer products, which the scales then turn into floats exactly as before.
`torch._int_mm` repacks the weight on every call: on a 2-core Xeon (no AMX) 12 layers of
Qwen2.5-1.5B-shaped matmuls took 15.4 / 26.2 / 28.6 / 29.5 ms for 1 / 2 / 5 / 8 rows with it,
15.7 / 16.4 / 19.9 / 21.4 ms prepacked. The packed op costs ~35 us more per call, so small
matrices (under PACKED_MIN_WEIGHTS entries; measured crossover for 5-row blocks between 1.6M and
4.4M) keep `_int_mm`, as does any build without the op. Both give the same floats.
"""

from __future__ import annotations

import torch
from torch import nn


class Int8Linear(nn.Module):
    """y = (round(x / sx) @ round(W / sw)^T) * sx * sw + b, with a symmetric scale per activation
    row (sx) and per output channel (sw)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # [out, in]
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
        weight_int8 = torch.round(weight / scale[:, None]).to(torch.int8)  # [out, in]
        self.packed = PACKED_KERNEL_AVAILABLE and weight.numel() >= PACKED_MIN_WEIGHTS
        # One copy of the weight: oneDNN's packed layout, or the plain int8 matrix for _int_mm.
        self.register_buffer("weight_int8", pack_weight(weight_int8) if self.packed else weight_int8)
        self.register_buffer("weight_scale", scale)  # [out]
        # The packed kernel's own scales and zero points stay 1 and 0: it returns raw integer products.
        self.register_buffer("unit_scales", torch.ones(linear.out_features), persistent=False)
        self.register_buffer("zero_points", torch.zeros(linear.out_features, dtype=torch.int64), persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] float32 -> [..., out]
        rows = x.reshape(-1, self.in_features)
        row_scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127  # [rows, 1]
        rows_int = torch.round(rows / row_scale)  # [rows, in], integers in -127..127
        if self.packed:
            product = packed_int_matmul(rows_int, self.weight_int8, self.unit_scales, self.zero_points)
        else:
            # The transposed view (no copy) keeps one-row products at the memory-bandwidth limit.
            product = torch._int_mm(rows_int.to(torch.int8), self.weight_int8.t()).float()  # [rows, out]
        y = product * row_scale * self.weight_scale
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def _packed_kernel_available() -> bool:
    try:
        probe = torch.ops.onednn.qlinear_prepack(torch.ones(4, 8, dtype=torch.int8), None)
        product = packed_int_matmul(torch.full((1, 8), -3.0), probe, torch.ones(4), torch.zeros(4, dtype=torch.int64))
    except (AttributeError, RuntimeError):  # no oneDNN build, or an op signature this code does not know
        return False
    return bool((product == -24).all())


def pack_weight(weight_int8: torch.Tensor) -> torch.Tensor:  # [out, in] int8 -> oneDNN's blocked layout
    return torch.ops.onednn.qlinear_prepack(weight_int8, None)


def packed_int_matmul(
    rows_int: torch.Tensor,  # [rows, in] float32 holding integers in -127..127
    packed_weight: torch.Tensor,  # pack_weight of [out, in] int8
    unit_scales: torch.Tensor,  # [out] float32 ones
    zero_points: torch.Tensor,  # [out] int64 zeros
) -> torch.Tensor:
    """[rows, out] float32: the exact int32 products (shifted to uint8 with zero point 128, which oneDNN compensates in
    integers), converted to float32 like `_int_mm(...).float()`."""
    shifted = (rows_int + 128).to(torch.uint8)
    return torch.ops.onednn.qlinear_pointwise(shifted, 1.0, 128, packed_weight, unit_scales, zero_points, None, 1.0, 0,
                                              torch.float32, "none", [], "")


def quantize_int8(module: nn.Module) -> nn.Module:
    """Replace every nn.Linear with an Int8Linear, in place (weights that nn.Linear shares, such
    as a tied LM head, get their own int8 copy)."""
    if next(module.parameters()).device.type != "cpu":
        raise ValueError("int8 quantization runs on CPU only (torch._int_mm); use --device cpu or drop --quantize")
    module.float()
    _replace_linears(module)
    return module


PACKED_KERNEL_AVAILABLE = _packed_kernel_available()
PACKED_MIN_WEIGHTS = 2**21


def _replace_linears(module: nn.Module) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear(child))
        else:
            _replace_linears(child)
