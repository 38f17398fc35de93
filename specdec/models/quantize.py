"""int8 weights on CPU, batch-invariant.

Decoding one token streams every weight once, so int8 weights are ~4x less memory traffic than
fp32 (`specdec bench --synthetic --precisions fp32 int8` measures what that buys on a machine).

Why not torch's `quantize_dynamic`: it quantizes the activations of a whole call with one
scale, so a row's result depends on the other rows in the block. The target would then score a
token differently inside a k-token verify block than alone, and speculative greedy output would
drift from target-only output (measured: 26 of 36 runs of a random 300M model differed).
Here every activation row gets its own scale and the int8 x int8 product accumulates exactly in
int32 (`torch._int_mm`), so each row's output is the same whatever else is in the block; the
lean model also attends one query row at a time after the prefill (LlamaFamilyModel.quantize_int8),
because int8 rounding turns SDPA's ~1e-7 block-vs-row differences into visible ones.

Kernels (specdec/models/int8_kernels.py): oneDNN's u8 x s8 -> s32 matmul on weights packed once
at load (`onednn.qlinear_prepack`), or `torch._int_mm`, which repacks the weight on every call.
Which one runs, and with 8-bit or 7-bit activations, is decided per machine and weight shape by a
self-check against an exact integer reference (oneDNN saturates without VNNI) and a timing, cached;
`kernel_notice()` is the one line the CLI prints about it. Every kernel that may run returns the
exact integer products, so the choice changes speed and the activation rounding, never row invariance.
"""

from __future__ import annotations

import collections

import torch
from torch import nn

from specdec.machine import isa_summary
from specdec.models.int8_kernels import Int8Kernel, KernelCache


class Int8Linear(nn.Module):
    """y = (round(x / sx) @ round(W / sw)^T) * sx * sw + b, with a symmetric scale per activation
    row (sx, mapping the row's largest magnitude to the kernel's activation_max) and per output
    channel (sw, to 127)."""

    weight_int8: torch.Tensor  # the int8 weight in the kernel's layout (Int8Kernel.prepare; a buffer)
    weight_scale: torch.Tensor  # [out] (a buffer)

    def __init__(self, weight_int8: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 kernel: Int8Kernel | None = None) -> None:
        """weight_int8 [out, in] int8 in the plain layout, weight_scale [out] float32 (int8_parts)."""
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.kernel = kernel or KERNELS.get(self.out_features, self.in_features).kernel  # (tests pass one)
        self.register_buffer("weight_int8", self.kernel.prepare(weight_int8))  # one copy, in the kernel's layout
        self.register_buffer("weight_scale", weight_scale)  # [out]
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @classmethod
    def of(cls, linear: nn.Linear, kernel: Int8Kernel | None = None) -> Int8Linear:
        return cls(*int8_parts(linear.weight), linear.bias, kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] float32 -> [..., out]
        rows = x.reshape(-1, self.in_features)
        activation_max = self.kernel.activation_max
        row_scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / activation_max  # [rows, 1]
        rows_int = torch.round(rows / row_scale)  # [rows, in], integers in -activation_max..activation_max
        y = self.kernel.matmul(rows_int, self.weight_int8) * row_scale * self.weight_scale  # [rows, out]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def int8_parts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (int8 [out, in], scale [out] float32): round(W / sw), sw to 127 per row."""
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
    return torch.round(weight / scale[:, None]).to(torch.int8), scale


def kernel_notice() -> str | None:
    """One line: the int8 kernels this process chose, on how many weight shapes, and the first
    reason each other candidate was not used (None if nothing was quantized)."""
    choices = list(KERNELS.choices.values())
    if not choices:
        return None
    used = collections.Counter(choice.kernel.description for choice in choices)
    used_names = {choice.kernel.name for choice in choices}
    refused: dict[str, str] = {}
    for choice in choices:
        for name, reason in choice.refused.items():
            if name not in used_names and not refused.get(name, "").startswith("wrong"):
                refused[name] = reason  # a wrong result outranks "slower" as the reason shown
    chosen = ", ".join(
        f"{description} ({count} of {len(choices)} weight shapes)" for description, count in used.items()
    )
    others = "; ".join(f"{name}: {reason}" for name, reason in refused.items())
    return f"int8 kernel on this CPU ({isa_summary()}): {chosen}" + (f"; not used: {others}" if others else "")


KERNELS = KernelCache()
