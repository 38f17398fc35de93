"""The Llama family's small pieces shared by the torch layer (transformer.py), its compiled twin
(fused_layer.py), the draft head and attention (attention.py, padded_chains.py)."""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and scale in the model's dtype, as the reference does.
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


class AttendingLayer(Protocol):
    """What attention reads of a layer: a decoder layer, its compiled twin, a draft head's layer."""

    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def window(self) -> int | None: ...  # sliding window, None = full attention


def scaled_dot_product(
    layer: AttendingLayer,
    q: torch.Tensor,  # [..., heads, k, d]
    keys: torch.Tensor,  # [..., kv_heads, length, d]
    values: torch.Tensor,  # [..., kv_heads, length, d]
    mask: torch.Tensor | None,  # [..., k, length] bool, True = may attend; None = all
) -> torch.Tensor:  # [..., heads, k, d]
    # A 16-bit cache (KVCache in float16 or bfloat16) is computed with in q's dtype: storage, not arithmetic.
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, scale=1.0 / math.sqrt(layer.head_dim),
        enable_gqa=layer.num_heads != layer.num_kv_heads,
    )
