"""A draft head that reads the target: EAGLE-3 (Li et al. 2025).

The head sees the target's hidden states at three depths (fused by ``fc`` into one vector), the
embedding of the next token (the target's own embedding, shared and frozen), and runs ONE
decoder layer whose attention input is concat(norm(embedding), norm(features)), with its own KV
cache and rope; a final norm and an LM head over a draft vocabulary (the most frequent target
tokens; ``d2t`` maps them back). From the second draft position on it feeds on its own output
features instead of the target's. Costs a small fraction of a target step.

Pairing: the head's entry at position t reads the target's features at t (those that predicted
token t + 1) and the embedding of token t + 1, and predicts token t + 2. Only relative positions
matter to rope, so heads trained elsewhere with another offset load unchanged.

The checkpoint layout is the one SpecForge and the EAGLE repository write (config.json with
``LlamaForCausalLMEagle3``; tensors fc, midlayer.*, norm, lm_head, d2t, t2d): see head_format.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models.attention import AttentionPlan, attend_planned, plan_attention
from specdec.models.base import Attention
from specdec.models.cache import KVCache
from specdec.models.primitives import RMSNorm, rotate_half
from specdec.models.transformer import DEFAULT_FIXED_ROWS, project


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's choice: the inputs of layers 2, L/2 and L-3, i.e. the outputs of layers 1,
    L/2 - 1 and L - 4 (clamped for tiny targets)."""
    return tuple(min(max(index, 0), num_layers - 1) for index in (1, num_layers // 2 - 1, num_layers - 4))


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    feature_layers: tuple[int, ...]  # target layers whose outputs are fused (fc's input, in this order)
    max_position_embeddings: int

    @property
    def feature_size(self) -> int:
        return len(self.feature_layers) * self.target_hidden_size


class HeadLayer(nn.Module):
    """The head's one decoder layer: attention over concat(norm(embedding), norm(features)),
    the residual taken from the features, then a SwiGLU MLP (as SpecForge's Eagle3 layer)."""

    window = None  # full attention (attend_planned reads it)
    softcap = None

    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.attention_scale = 1.0 / math.sqrt(c.head_dim)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)  # on the features
        self.qkv_proj = nn.Linear(2 * c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def queries_keys_values(
        self,
        embeds: torch.Tensor,  # [n, hidden]
        features: torch.Tensor,  # [n, hidden]
        cos: torch.Tensor,  # [n, head_dim]
        sin: torch.Tensor,  # [n, head_dim]
        fixed_rows: int | None = None,  # see transformer.project()
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [heads, n, d], k and v [kv_heads, n, d]
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(features)], dim=-1)
        qkv = project(self.qkv_proj, x, fixed_rows).view(x.shape[0], -1, self.head_dim).transpose(0, 1)
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=0)
        qk = qk * cos + rotate_half(qk) * sin
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=0)
        return q, k, v

    def finish(self, features: torch.Tensor, attended: torch.Tensor,
               fixed_rows: int | None = None) -> torch.Tensor:  # [n, hidden] x2 -> [n, hidden]
        x = features + project(self.o_proj, attended, fixed_rows)
        gate, up = project(self.gate_up_proj, self.post_attention_layernorm(x), fixed_rows).chunk(2, dim=-1)
        return x + project(self.down_proj, F.silu(gate) * up, fixed_rows)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                plan: AttentionPlan, cache: KVCache, fixed_rows: int | None = None) -> torch.Tensor:  # [n, hidden]
        q, k, v = self.queries_keys_values(embeds, features, cos, sin, fixed_rows)
        return self.finish(features, attend_planned(self, q, k, v, plan, cache, 0), fixed_rows)


class DraftHead(nn.Module):
    """fc + one HeadLayer + norm + a draft-vocabulary LM head, over the target's frozen embedding.

    Stateless between calls (its KV cache is the caller's), like the target's forward."""

    # Buffers (register_buffer in __init__), named here so that type checkers see tensors.
    embed_weight: torch.Tensor  # [vocab, hidden], the target's, frozen
    d2t: torch.Tensor  # [draft_vocab] int64
    t2d: torch.Tensor  # [vocab] bool
    inv_freq: torch.Tensor  # [head_dim / 2] float32

    def __init__(self, config: HeadConfig, embed_weight: torch.Tensor) -> None:  # embed_weight [vocab, hidden]
        super().__init__()
        c = self.config = config
        if tuple(embed_weight.shape) != (c.vocab_size, c.hidden_size):
            raise ValueError(f"the head needs the target's embedding of shape ({c.vocab_size}, {c.hidden_size}); "
                             f"got {tuple(embed_weight.shape)}: is this head for another target?")
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)  # shared, frozen
        self.fc = nn.Linear(c.feature_size, c.hidden_size, bias=False)
        self.midlayer = HeadLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.quantized: str | None = None  # "int8" / "int4" once quantize_linears ran (it sets this)
        # lm_head(norm(x)) in one compiled call, where drafting/fused_head.py's fuse_head set it
        self.norm_then_head: Callable[[torch.Tensor], torch.Tensor] | None = None
        # Draft token i is target token i + d2t[i]; t2d marks the target tokens the head can draft.
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        exponents = torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim
        self.register_buffer("inv_freq", 1.0 / (c.rope_theta ** exponents), persistent=False)

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:  # [draft_vocab] int64, the target ids drafted
        if token_ids.shape != (self.config.draft_vocab_size,) or token_ids.unique().shape != token_ids.shape:
            raise ValueError(f"a draft vocabulary is {self.config.draft_vocab_size} distinct target token ids")
        order = token_ids.sort().values  # d2t offsets are defined over ascending ids, as SpecForge writes them
        self.d2t.copy_(order - torch.arange(order.shape[0]))
        self.t2d.zero_()
        self.t2d[order] = True

    @property
    def draft_token_ids(self) -> torch.Tensor:  # [draft_vocab] int64: the target id of each draft token
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    @property
    def dtype(self) -> torch.dtype:  # the norm's: it stays float when the linears are quantized
        return self.norm.weight.dtype

    def new_cache(self, max_length: int, rows: int = 1) -> KVCache:
        c = self.config
        return KVCache(1, c.num_kv_heads, c.head_dim, max_length, self.dtype, self.norm.weight.device, rows)

    def fuse(self, target_hidden: torch.Tensor,  # [n, features] -> [n, hidden]
             batch_invariant: bool = False) -> torch.Tensor:
        """The target's features at several depths as one vector (the first draft position only);
        batch_invariant: each row's as it is alone (see forward)."""
        fixed_rows = self.fixed_rows(batch_invariant)
        fused = project(self.fc, pad_rows(target_hidden.to(self.dtype), fixed_rows), fixed_rows)
        return fused[: target_hidden.shape[0]]

    def fixed_rows(self, batch_invariant: bool) -> int | None:
        """Rows per linear call for batch invariance: integer products are exact in any blocking,
        so a quantized head needs none (as the target: transformer.quantize)."""
        return DEFAULT_FIXED_ROWS if batch_invariant and not self.quantized else None

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [n] -> cos, sin [n, head_dim]
        angles = positions.to(self.inv_freq.dtype)[:, None] * self.inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    def logits(self, features: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, draft_vocab]
        return self.lm_head(self.norm(features))

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [n] int64, target ids: the token after each feature vector's position
        features: torch.Tensor,  # [n, hidden]: fuse(target hidden) or the head's own earlier output
        positions: torch.Tensor,  # [n] int64
        cache: KVCache,
        attention: Attention,
        logit_rows: torch.Tensor | None = None,  # [k] int64: the rows whose logits are wanted (None: all)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # draft logits [n or k, draft_vocab], output features [n, hidden]
        """Score a ragged block as the target's forward does (models/base.py): chains or trees,
        written past each row's committed length and not committed. Where the attention asks for
        batch invariance, each row gets what it gets alone, in any batch: float linears in calls of
        DEFAULT_FIXED_ROWS rows and attention per query after a row's first entries (the
        target's own scheme, transformer.make_batch_invariant), so that a request's drafts never
        depend on the requests drafting beside it. ``logit_rows``: the LM head runs on those rows
        only (feeding a backlog wants the last row's), each row's logits what they are among all."""
        cache.reserve(max(cache.lengths[s.row] + s.written + s.count for s in attention.segments))
        fixed_rows = self.fixed_rows(attention.batch_invariant)
        plan = plan_attention(attention, positions, cache, {None}, per_query=attention.batch_invariant)
        cos, sin = self.rope(positions)
        embeds = F.embedding(tokens, self.embed_weight).to(self.dtype)
        embeds, features, cos, sin = (pad_rows(x, fixed_rows) for x in (embeds, features.to(self.dtype), cos, sin))
        out = self.midlayer(embeds, features, cos, sin, plan, cache, fixed_rows)
        count = tokens.shape[0]
        out = out[:count]
        scored = out if logit_rows is None else out[logit_rows]
        if self.norm_then_head is not None:
            return self.norm_then_head(scored), out
        return project(self.lm_head, pad_rows(self.norm(scored), fixed_rows), fixed_rows)[: scored.shape[0]], out


def pad_rows(x: torch.Tensor, fixed_rows: int | None) -> torch.Tensor:  # [n, ...] -> [n + padding, ...]
    """x with zero rows up to a multiple of fixed_rows (None: as it is), as transformer.project() needs."""
    return x if fixed_rows is None else F.pad(x, (0, 0, 0, -x.shape[0] % fixed_rows))
