"""The Llama family's small pieces shared by the torch layer (transformer.py), its compiled twin
(fused_layer.py), the draft head and attention (attention.py, padded_chains.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


def widen_logits(logits: torch.Tensor,  # [n, subset]
                 token_ids: torch.Tensor,  # [subset] int64: the token of each column
                 vocab_size: int) -> torch.Tensor:  # [n, vocab_size]
    """Logits over a subset of the vocabulary as logits over all of it: -inf for every other token
    (so q is 0 there and they are never drafted)."""
    wide = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
    return wide.index_copy_(1, token_ids, logits)


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
    @property
    def attention_scale(self) -> float: ...  # multiplies q . k (head_dim ** -0.5 unless the config says)
    @property
    def softcap(self) -> float | None: ...  # scores -> softcap * tanh(scores / softcap) (gemma2); None = none


def scaled_dot_product(
    layer: AttendingLayer,
    q: torch.Tensor,  # [..., heads, k, d]
    keys: torch.Tensor,  # [..., kv_heads, length, d]
    values: torch.Tensor,  # [..., kv_heads, length, d]
    mask: torch.Tensor | None,  # [..., k, length] bool, True = may attend; None = all
) -> torch.Tensor:  # [..., heads, k, d]
    # A 16-bit cache (KVCache in float16 or bfloat16) is computed with in q's dtype: storage, not arithmetic.
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    if layer.softcap is not None:
        return soft_capped_attention(layer, q, keys, values, mask)
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, scale=layer.attention_scale,
        enable_gqa=layer.num_heads != layer.num_kv_heads,
    )


def soft_capped_attention(
    layer: AttendingLayer,
    q: torch.Tensor,  # [..., heads, k, d]
    keys: torch.Tensor,  # [..., kv_heads, length, d], in q's dtype
    values: torch.Tensor,  # [..., kv_heads, length, d]
    mask: torch.Tensor | None,  # [..., k, length] bool, True = may attend
) -> torch.Tensor:  # [..., heads, k, d]
    """Attention whose scores are soft-capped before the softmax (gemma2's attn_logit_softcapping),
    in the reference's order: scores * scale, / cap, tanh, * cap, masked, softmax in float32."""
    assert layer.softcap is not None
    group = layer.num_heads // layer.num_kv_heads
    keys, values = keys.repeat_interleave(group, dim=-3), values.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * layer.attention_scale
    scores = torch.tanh(scores / layer.softcap) * layer.softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, values)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# The MLP's gate activations the own forward runs, by the name a config gives (as transformers
# writes them) -> the one name the forward knows it by (TransformerConfig.hidden_act).
ACTIVATION_NAMES = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "gelu_tanh": gelu_tanh}
