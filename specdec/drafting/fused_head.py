"""A draft head's forward on the target's compiled layer calls (models/fused_layer.py), where its
linears are packed (int4 or w8a32, as the target's): FusedHeadLayer takes the place of HeadLayer,
and the final norm and draft-vocabulary head run as one call.

Why: a one-token head step is ~31 M weights (~19 MB in int4, under a millisecond of streaming),
but as ~25 small torch ops (two norms, a concatenation, RoPE's rotate, the MLP's pieces) its
dispatch cost exceeded its matmuls'. Here a depth is: norms + q/k/v matmul + RoPE (one call),
attention (one call for the per-query tokens), o matmul + residual + norm + gate/up + SiLU + down +
residual (one call), norm + LM head (one call).

Exactness: each row is computed by the same code alone or in any block (layer_ops.cpp), so a
request's drafts never depend on its neighbours (the head's batch invariance). The results are
close to, not the same bits as, the torch head (other summation orders): q is whatever the head
computes, and verification is exact against it, so drafting stays lossless either way.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from specdec.drafting.head import DraftHead, HeadLayer
from specdec.models.attention import AttentionPlan
from specdec.models.cache import KVCache
from specdec.models.fused_layer import FusedOutput, attend_compiled, head_qkv_projection, layer_problem, mlp_block
from specdec.models.int4 import PackedLinear
from specdec.models.primitives import RMSNorm


class FusedHeadLayer(nn.Module):
    """A draft head's HeadLayer (drafting/head.py) whose linears share a packed format, as three
    compiled calls and the compiled attention; the same modules and the same forward signature."""

    window = None  # full attention
    softcap = None
    # The Llama layer's MLP: no norms on the outputs, SiLU (mlp_block reads them).
    attention_out_norm: RMSNorm | None = None
    mlp_out_norm: RMSNorm | None = None
    hidden_act = "silu"

    def __init__(self, layer: HeadLayer) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
        self.attention_scale = layer.attention_scale
        self.eps = layer.post_attention_layernorm.eps
        self.input_layernorm, self.hidden_norm = layer.input_layernorm, layer.hidden_norm
        self.post_attention_norm = layer.post_attention_layernorm  # the name mlp_block reads
        linears = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        if not all(isinstance(linear, PackedLinear) for linear in linears):
            raise ValueError("a compiled head layer needs packed linears (int4 or w8a32)")
        self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj = cast(tuple[PackedLinear, ...], linears)

    def forward(
        self,
        embeds: torch.Tensor,  # [n, hidden]
        features: torch.Tensor,  # [n, hidden]
        cos: torch.Tensor,  # [n, head_dim]
        sin: torch.Tensor,  # [n, head_dim]
        plan: AttentionPlan,
        cache: KVCache,
        fixed_rows: int | None = None,  # unused: each row is computed alone in any block
    ) -> torch.Tensor:  # [n, hidden]
        qkv = head_qkv_projection(self.qkv_proj, self.input_layernorm, self.hidden_norm, embeds, features, cos, sin,
                                  self.num_heads + self.num_kv_heads, self.head_dim).transpose(0, 1)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=0)
        return mlp_block(self, features, attend_compiled(self, q, k, v, plan, cache, 0))


def packed_head_format(head: DraftHead) -> int | None:
    """The packed layout (4: int4, 8: w8a32) that the head's layer linears and LM head all share, else None."""
    layer = head.midlayer
    if not isinstance(layer, HeadLayer):
        return None
    linears = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj, head.lm_head)
    formats = {linear.format if isinstance(linear, PackedLinear) else None for linear in linears}
    return formats.pop() if len(formats) == 1 else None


def fuse_head(head: DraftHead) -> str | None:
    """In place: the compiled layer and output for a head whose linears share a packed format, if
    the compiled layer passes its self-check here (layer_problem); else why not (the torch head stays)."""
    format = packed_head_format(head)
    if format is None or not isinstance(head.lm_head, PackedLinear):  # (the check types lm_head)
        return "the head's linears are not all packed (int4 or w8a32)"
    problem = layer_problem(format)
    if problem is None:
        # setattr: DraftHead types its layer as HeadLayer; this one has the same forward signature
        setattr(head, "midlayer", FusedHeadLayer(head.midlayer))  # noqa: B010
        head.norm_then_head = FusedOutput(head.norm, head.lm_head)
    return problem
