"""specdec's own forward: one config-driven decoder for the families in architectures.py.

The Llama layer (RMSNorm, RoPE with the rope_scaling kinds checkpoints use, grouped-query
attention, a gated MLP, tied or untied embeddings, biases, sliding windows) plus what a family and
its config turn on (TransformerConfig: q/k norms, norms on the outputs, GELU, scales, soft-capping,
per-layer windows and rope tables, layers without RoPE, partial rotary). The q/k/v and gate/up
projections are fused into one matmul each at load time: on a CPU most of a small model's time is
per-op overhead, so fewer, larger ops are faster.

``forward(tokens, positions, cache, attention)`` scores a ragged block (see models/base.py):
one token when decoding, a chain or a tree of drafts when verifying, several requests at once.
The linear layers run over the whole flattened block; attention runs per segment, over that
segment's cache row.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models.architectures import FAMILIES, SUPPORTED_MODEL_TYPES, UNSUPPORTED_REASONS
from specdec.models.attention import AttentionPlan, attend_planned, plan_attention
from specdec.models.base import Attention, ForwardOutput, check_forward, check_hidden_layers
from specdec.models.cache import KVCache
from specdec.models.paged_cache import BLOCK_SIZE, OwnCache, PagedKVCache
from specdec.models.primitives import ACTIVATION_NAMES, ACTIVATIONS, RMSNorm, rotate_half, widen_logits

LEAN_MODEL_TYPES = SUPPORTED_MODEL_TYPES
# Rope kinds a position-indexed cache can follow. "longrope" (Phi-3.5, Phi-4-mini) changes its
# frequencies past original_max_position_embeddings: the own forward runs it up to there (its short
# factors, as the reference does there) and caps the context; "dynamic" changes them at every
# length, so it uses the adapter.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
DEFAULT_FIXED_ROWS = 8
DEFAULT_ROPE = "default"  # the rope table's name where every layer shares one


class UnsupportedByLeanModel(ValueError):
    """The checkpoint is valid but uses a feature the lean forward does not implement."""


@dataclass(frozen=True)
class TransformerConfig:
    """One decoder for every family in architectures.FAMILIES: the Llama layer plus what the
    family and the config turn on. Fields after sliding_windows default to the Llama layer."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q, k and v (qwen2 always, llama optionally)
    output_bias: bool  # bias on o_proj (llama's attention_bias; qwen2 has none there)
    mlp_bias: bool
    sliding_windows: tuple[int | None, ...]  # per layer: window size, None = full attention
    qk_norm: str | None = None  # "head" (per head: qwen3, gemma3), "projection" (over all heads: olmo2)
    pre_norms: bool = True  # RMSNorm on attention's and the MLP's inputs
    post_norms: bool = False  # RMSNorm on attention's and the MLP's outputs (gemma2/3, olmo2)
    hidden_act: str = "silu"  # the MLP gate's activation: a key of primitives.ACTIVATIONS
    embedding_scale: float | None = None  # embeddings times this (gemma: sqrt(hidden); granite's multiplier)
    attention_scale: float | None = None  # q . k times this; None: 1 / sqrt(head_dim)
    attention_softcap: float | None = None  # gemma2's attn_logit_softcapping
    final_softcap: float | None = None  # gemma2's final_logit_softcapping
    logits_divisor: float | None = None  # granite's logits_scaling
    residual_scale: float = 1.0  # granite's residual_multiplier, folded into o_proj and down_proj at load
    # Per layer: the name of its rope table (rope_frequencies), or None for a layer without RoPE
    # (smollm3's no_rope_layers); None for the whole tuple: every layer uses DEFAULT_ROPE.
    rope_layers: tuple[str | None, ...] | None = None
    rotary_dim: int | None = None  # RoPE on each head's first rotary_dim dims (phi3's partial_rotary_factor)

    @property
    def rotary(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def scale(self) -> float:  # 1 / sqrt(d) as before this field existed: the same bits for llama, qwen2, mistral
        return 1.0 / math.sqrt(self.head_dim) if self.attention_scale is None else self.attention_scale

    @property
    def layer_ropes(self) -> tuple[str | None, ...]:
        return self.rope_layers or (DEFAULT_ROPE,) * self.num_layers

    @classmethod
    def from_hf(cls, hf_config) -> TransformerConfig:
        model_type = hf_config.model_type
        if model_type in UNSUPPORTED_REASONS:
            raise UnsupportedByLeanModel(f"model_type {model_type!r} is {UNSUPPORTED_REASONS[model_type]}")
        if model_type not in FAMILIES:
            raise UnsupportedByLeanModel(f"model_type {model_type!r} is not one of {', '.join(FAMILIES)}")
        family = FAMILIES[model_type]
        activation = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", "silu")
        if activation not in ACTIVATION_NAMES:
            raise UnsupportedByLeanModel(f"activation {activation!r} (implemented: {', '.join(ACTIVATION_NAMES)})")
        num_heads = hf_config.num_attention_heads
        num_layers = hf_config.num_hidden_layers
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        layer_types = getattr(hf_config, "layer_types", None)
        bias = bool(getattr(hf_config, "attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=rope_context(hf_config),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=family.qkv_bias_always or bias,
            output_bias=family.output_bias_with_attention_bias and bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            sliding_windows=sliding_windows(hf_config, num_layers),
            qk_norm=family.qk_norm,
            pre_norms=family.pre_norms,
            post_norms=family.post_norms,
            hidden_act=ACTIVATION_NAMES[activation],
            embedding_scale=hf_config.hidden_size ** 0.5 if family.embedding_scale_sqrt_hidden
            else getattr(hf_config, "embedding_multiplier", None),
            attention_scale=attention_scale(hf_config),
            attention_softcap=getattr(hf_config, "attn_logit_softcapping", None),
            final_softcap=getattr(hf_config, "final_logit_softcapping", None),
            logits_divisor=getattr(hf_config, "logits_scaling", None),
            residual_scale=float(getattr(hf_config, "residual_multiplier", 1.0)),
            rope_layers=rope_layers(hf_config, num_layers, layer_types),
            rotary_dim=rotary_dim(hf_config, head_dim),
        )


def rope_context(hf_config) -> int:
    """The longest context the own forward runs: the config's, or for longrope the context its
    short factors cover (original_max_position_embeddings), where it matches the reference."""
    params = rope_parameters(hf_config) if not per_layer_rope(hf_config) else {}
    if params.get("rope_type") == "longrope":
        return min(hf_config.max_position_embeddings, int(params["original_max_position_embeddings"]))
    return hf_config.max_position_embeddings


def rotary_dim(hf_config, head_dim: int) -> int | None:
    """How many of each head's dims RoPE turns (partial_rotary_factor), None for all of them."""
    params = rope_parameters(hf_config) if not per_layer_rope(hf_config) else {}
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None) or 1.0)
    if partial == 1.0:
        return None
    dims = int(head_dim * partial)
    if dims % 2 or not 0 < dims <= head_dim:
        raise UnsupportedByLeanModel(f"partial_rotary_factor {partial} turns {dims} of {head_dim} dims (not an even "
                                     "number of them)")
    return dims


def sliding_windows(hf_config, num_layers: int) -> tuple[int | None, ...]:
    """Per layer: its sliding window, or None for full attention (layer_types where the config
    has them; use_sliding_window False turns every window off, as qwen2, qwen3 and smollm3 do)."""
    window = getattr(hf_config, "sliding_window", None)
    if getattr(hf_config, "use_sliding_window", True) is False:
        window = None
    layer_types = getattr(hf_config, "layer_types", None)
    if window is None:
        return (None,) * num_layers
    if layer_types is not None:
        return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    return (window,) * num_layers


def attention_scale(hf_config) -> float | None:
    """What q . k is multiplied by where the config says (gemma's query_pre_attn_scalar ** -0.5,
    granite's attention_multiplier); None: head_dim ** -0.5."""
    if getattr(hf_config, "query_pre_attn_scalar", None) is not None:
        return float(hf_config.query_pre_attn_scalar) ** -0.5
    multiplier = getattr(hf_config, "attention_multiplier", None)
    return None if multiplier is None else float(multiplier)


def per_layer_rope(hf_config) -> bool:
    """Whether the config gives each layer type its own rope settings (gemma3: local 10k, global 1M)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return bool(params) and all(isinstance(value, dict) for value in params.values())


def rope_layers(hf_config, num_layers: int, layer_types: list[str] | None) -> tuple[str | None, ...] | None:
    """Per layer: its rope table's name (its layer type where types have their own rope), or
    None where a layer has no RoPE (smollm3's no_rope_layers: 1 = rope, 0 = none)."""
    names: list[str | None] = list(layer_types) if per_layer_rope(hf_config) and layer_types else \
        [DEFAULT_ROPE] * num_layers
    no_rope = getattr(hf_config, "no_rope_layers", None)
    if no_rope is not None:
        names = [name if uses else None for name, uses in zip(names, no_rope, strict=True)]
    return None if all(name == DEFAULT_ROPE for name in names) else tuple(names)


def rope_parameters(hf_config, layer_type: str | None = None) -> dict:
    """The rope settings whatever transformers version wrote the config (rope_scaling + rope_theta
    in 4.x, rope_parameters in 5.x, per layer type where the config has them)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    if layer_type is not None:
        params = dict(params[layer_type])
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def rope_inverse_frequencies(hf_config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [head_dim / 2], attention_scaling) for the config's rope kind (of
    ``layer_type``, where the config has rope settings per layer type); head_dim: the dims RoPE
    turns (the rotary part of a head, where only part is turned)."""
    params = rope_parameters(hf_config, layer_type)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedByLeanModel(f"rope type {rope_type!r}: its frequencies change with the sequence length, "
                                     f"which a position-indexed cache cannot follow (supported: "
                                     f"{', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    # The scaled kinds follow transformers' own definitions, so both forwards agree exactly.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    extra = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", **extra)
    return inv_freq.float(), float(attention_scaling)


def rope_frequencies(hf_config, config: TransformerConfig) -> dict[str, tuple[torch.Tensor, float]]:
    """Each rope table the layers name (config.layer_ropes): (inv_freq [rotary / 2], attention_scaling)."""
    names = sorted({name for name in config.layer_ropes if name is not None}) or [DEFAULT_ROPE]
    return {name: rope_inverse_frequencies(hf_config, config.rotary, None if name == DEFAULT_ROPE else name)
            for name in names}


def project(linear: nn.Module, x: torch.Tensor, fixed_rows: int | None) -> torch.Tensor:
    """linear(x) for x [n, in]; with fixed_rows (n a multiple of it), as calls of exactly that many
    rows. A float matmul kernel picks its blocking, and so its summation order, from the row count:
    one row alone and the same row inside a 5-row block can differ in the last bits. Calls of one
    shape make every row's result independent of the block it is in."""
    if fixed_rows is None or x.shape[0] == fixed_rows:
        return linear(x)
    return torch.cat([linear(chunk) for chunk in x.split(fixed_rows)])


def optional_norm(present: bool, size: int, eps: float) -> RMSNorm | None:
    return RMSNorm(size, eps) if present else None


def apply_norm(norm: RMSNorm | None, x: torch.Tensor) -> torch.Tensor:
    return x if norm is None else norm(x)


class DecoderLayer(nn.Module):
    """The decoder layer of every family: [norm] -> q/k/v -> [q/k norms] -> [RoPE] -> attention ->
    o -> [norm] -> + residual, then [norm] -> gate/up -> activation -> down -> [norm] -> + residual
    (the bracketed steps as the config turns them on). ``input_norm`` and ``post_attention_norm``
    are the norms on attention's and the MLP's inputs (transformers' Llama names); gemma and olmo2's
    norms on the outputs are ``attention_out_norm`` and ``mlp_out_norm``."""

    def __init__(self, config: TransformerConfig, window: int | None) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.window = window
        self.attention_scale, self.softcap = c.scale, c.attention_softcap
        self.qk_norm, self.hidden_act, self.rotary = c.qk_norm, c.hidden_act, c.rotary
        self.eps = c.rms_norm_eps
        self.input_norm = optional_norm(c.pre_norms, c.hidden_size, c.rms_norm_eps)
        self.qkv_proj = nn.Linear(c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, bias=c.attention_bias)
        if c.qk_norm is not None:
            per_head = c.qk_norm == "head"
            self.q_norm = RMSNorm(c.head_dim if per_head else c.num_heads * c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim if per_head else c.num_kv_heads * c.head_dim, c.rms_norm_eps)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.output_bias)
        self.attention_out_norm = optional_norm(c.post_norms, c.hidden_size, c.rms_norm_eps)
        self.post_attention_norm = optional_norm(c.pre_norms, c.hidden_size, c.rms_norm_eps)
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)
        self.mlp_out_norm = optional_norm(c.post_norms, c.hidden_size, c.rms_norm_eps)

    def queries_keys_values(
        self,
        x: torch.Tensor,  # [n, hidden]
        cos: torch.Tensor | None,  # [n, rotary]; None: a layer without RoPE
        sin: torch.Tensor | None,
        fixed_rows: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [heads, n, d], k and v [kv_heads, n, d]
        h, g, d = self.num_heads, self.num_kv_heads, self.head_dim
        num_tokens = x.shape[0]
        qkv = project(self.qkv_proj, apply_norm(self.input_norm, x), fixed_rows)  # [n, (h + 2 g) * d]
        if self.qk_norm == "projection":
            q, k, v = qkv.split([h * d, g * d, g * d], dim=1)
            qkv = torch.cat([self.q_norm(q), self.k_norm(k), v], dim=1)
        qk, v = qkv.view(num_tokens, -1, d).transpose(0, 1).split([h + g, g], dim=0)  # [heads, n, d]
        if self.qk_norm == "head":
            qk = torch.cat([self.q_norm(qk[:h]), self.k_norm(qk[h:])])
        if cos is not None and sin is not None and self.rotary < d:  # RoPE on the first rotary dims only
            turned, kept = qk.split([self.rotary, d - self.rotary], dim=-1)
            qk = torch.cat([turned * cos + rotate_half(turned) * sin, kept], dim=-1)
        elif cos is not None and sin is not None:
            qk = qk * cos + rotate_half(qk) * sin  # rope on q and k in one go: fewer ops per layer
        q, k = qk.split([h, g], dim=0)
        return q, k, v

    def mlp_residual(
        self,
        x: torch.Tensor,  # [n, hidden], the layer's input
        attended: torch.Tensor,  # [n, heads * d]
        fixed_rows: int | None = None,
    ) -> torch.Tensor:  # [n, hidden], the layer's output
        x = x + apply_norm(self.attention_out_norm, project(self.o_proj, attended, fixed_rows))
        gate, up = project(self.gate_up_proj, apply_norm(self.post_attention_norm, x), fixed_rows).chunk(2, dim=-1)
        mlp = project(self.down_proj, ACTIVATIONS[self.hidden_act](gate) * up, fixed_rows)
        return x + apply_norm(self.mlp_out_norm, mlp)

    def forward(
        self,
        x: torch.Tensor,  # [n, hidden], every segment's new tokens (+ zero rows up to a multiple of fixed_rows)
        cos: torch.Tensor | None,  # [n, head_dim]; None: a layer without RoPE
        sin: torch.Tensor | None,  # [n, head_dim]
        plan: AttentionPlan,
        cache: OwnCache,
        layer_index: int,
        fixed_rows: int | None = None,  # see project(); padding rows are never attended
    ) -> torch.Tensor:  # [n, hidden]
        q, k, v = self.queries_keys_values(x, cos, sin, fixed_rows)
        return self.mlp_residual(x, attend_planned(self, q, k, v, plan, cache, layer_index), fixed_rows)


class SubsetHead(nn.Module):
    """An output head over a subset of the vocabulary, for drafts: logits for ``token_ids`` from
    their rows of the full head, -inf for every other token (so q is 0 there and they are
    never drafted; rejection sampling stays exact for any q). Cheaper: a 135M model's 49152-row
    head was a third of a 3-layer draft's step."""

    token_ids: torch.Tensor  # [subset] (a buffer)

    def __init__(self, head_weight: torch.Tensor, token_ids: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(head_weight.shape[1], token_ids.shape[0], bias=False)
        self.linear.weight = nn.Parameter(head_weight[token_ids].clone(), requires_grad=False)
        self.register_buffer("token_ids", token_ids)  # [subset]
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [n, hidden] -> [n, vocab]
        return widen_logits(self.linear(x), self.token_ids, self.vocab_size)


class LlamaFamilyModel(nn.Module):
    """Weights plus rope tables; stateless between calls (all state lives in the KVCache), so
    one set of weights can serve as both target and draft with two caches."""

    rope_cos: torch.Tensor  # [tables, max_positions, head_dim] buffers (set_rope_tables)
    rope_sin: torch.Tensor

    def __init__(self, config: TransformerConfig, ropes: dict[str, tuple[torch.Tensor, float]]) -> None:
        super().__init__()
        c = self.config = config
        # Given its weight (uninitialized): the checkpoint sets it, and an init would cost a vocabulary's randoms.
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, _weight=torch.empty(c.vocab_size, c.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(c, window) for window in c.sliding_windows)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        # nn.Linear, SubsetHead (restrict_output) or a packed linear (precisions.Packer)
        self.lm_head: nn.Module = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        names = list(ropes)
        # Each layer's index into the rope tables, or None for a layer without RoPE.
        self.rope_index = [None if name is None else names.index(name) for name in c.layer_ropes]
        self.set_rope_tables(ropes)
        self.quantized: str | None = None  # the precision that replaced the linears (precisions.py)
        self.quantize_notice: str | None = None  # the one line the CLI prints about it
        # One call for lm_head(norm(x)) on the last layer's output ([n, hidden] -> [n, vocab]), where
        # a precision has a faster equivalent of the two (precisions.quantize_model); None: the two.
        self.norm_then_head: Callable[[torch.Tensor], torch.Tensor] | None = None
        # Every decoder layer in one call where a precision has one (precisions.finish_network:
        # layer_stack.LayerStack): (x, cos, sin, plan, cache, hidden_layers) -> (x, {layer: output}),
        # or None for a forward it does not run; None: the layers one by one.
        self.layer_stack: Callable[..., tuple[torch.Tensor, dict[int, torch.Tensor]] | None] | None = None
        self.fixed_rows: int | None = None  # set by make_batch_invariant
        # What the KV cache stores keys and values in (None: the weights' dtype); arithmetic stays in
        # self.dtype. float16 for int4 on the compiled layer (precisions.quantize_model), or load(kv_dtype=).
        self.kv_dtype: torch.dtype | None = None

    def restrict_output(self, token_ids: torch.Tensor) -> LlamaFamilyModel:
        """Score only ``token_ids`` [subset] (SubsetHead): for drafts, before any quantization."""
        if self.quantized or not isinstance(self.lm_head, nn.Linear):
            raise ValueError("restrict the output once, before quantizing")
        if token_ids.unique().shape[0] != token_ids.shape[0] or not (0 <= token_ids).all() or \
                not (token_ids < self.config.vocab_size).all():
            raise ValueError(
                f"output token ids must be distinct ids below the vocabulary size {self.config.vocab_size}")
        self.lm_head = SubsetHead(self.lm_head.weight.detach(), token_ids.to(self.device), self.config.vocab_size)
        return self

    def make_batch_invariant(self, fixed_rows: int = DEFAULT_FIXED_ROWS) -> LlamaFamilyModel:
        """Exact verify blocks in float dtypes: after the prefill, wherever the caller asks for batch
        invariance, the linears run in calls of `fixed_rows` rows (project()) and attention per
        query (QueryGroup), so a token inside a verify block gets the logits it gets alone. int8
        models need only the attention part (integer products are exact in any blocking)."""
        if fixed_rows < 1:
            raise ValueError(f"fixed_rows must be at least 1, got {fixed_rows}")
        self.fixed_rows = None if self.quantized else fixed_rows
        return self

    def set_rope_tables(self, ropes: dict[str, tuple[torch.Tensor, float]]) -> None:
        """cos/sin of each rope table (name -> (inv_freq, attention_scaling)) for every absolute
        position, kept in float32 (cast per forward) like the reference."""
        cos, sin = [], []
        for inv_freq, attention_scaling in ropes.values():
            positions = torch.arange(self.config.max_position_embeddings, dtype=torch.float32, device=inv_freq.device)
            angles = torch.outer(positions, inv_freq)
            angles = torch.cat([angles, angles], dim=-1)  # [max_positions, head_dim]
            cos.append(angles.cos() * attention_scaling)
            sin.append(angles.sin() * attention_scaling)
        self.register_buffer("rope_cos", torch.stack(cos), persistent=False)
        self.register_buffer("rope_sin", torch.stack(sin), persistent=False)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden]
        x = self.embed_tokens(tokens)
        scale = self.config.embedding_scale
        # gemma multiplies by sqrt(hidden) rounded to the weights' dtype, as transformers does
        return x if scale is None else x * torch.tensor(scale, dtype=x.dtype)

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:  # [n, vocab]
        """Granite's logits divisor and gemma2's final soft-cap, as the reference applies them."""
        c = self.config
        if c.logits_divisor is not None:
            logits = logits / c.logits_divisor
        if c.final_softcap is not None:
            logits = torch.tanh(logits / c.final_softcap) * c.final_softcap
        return logits

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def _cache_shape(self, max_length: int | None, rows: int,
                     ) -> tuple[int, int, int, int, torch.dtype, torch.device, int]:
        c = self.config
        return (c.num_layers, c.num_kv_heads, c.head_dim, max_length or c.max_position_embeddings,
                self.kv_dtype or self.dtype, self.device, rows)

    def new_cache(self, max_length: int | None = None, rows: int = 1) -> KVCache:
        """A cache of ``rows`` rows of up to ``max_length`` positions, each a whole tensor row."""
        return KVCache(*self._cache_shape(max_length, rows))

    def new_paged_cache(self, rows: int, pool_tokens: int, max_length: int | None = None,
                        growable: bool = False) -> PagedKVCache:
        """``rows`` rows of up to ``max_length`` positions sharing one pool of ``pool_tokens``
        tokens (rounded up to whole blocks; ``growable``: doubled when it runs dry)."""
        return PagedKVCache(*self._cache_shape(max_length, rows), num_blocks=-(-pool_tokens // BLOCK_SIZE),
                            growable=growable)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [n] int64, every segment's new tokens, flattened
        positions: torch.Tensor,  # [n] int64, absolute positions
        cache: OwnCache,
        attention: Attention,
        want_logits: bool = True,
        hidden_layers: tuple[int, ...] = (),  # decoder layers whose outputs to return, concatenated
    ) -> ForwardOutput:
        check_forward(tokens, positions, cache, attention)
        for segment in attention.segments:
            cache.ensure(segment.row, cache.lengths[segment.row] + segment.written + segment.count)
        cos = self.rope_cos[:, positions].to(self.dtype)  # [tables, n, head_dim]
        sin = self.rope_sin[:, positions].to(self.dtype)
        windows = set(self.config.sliding_windows)
        # An int8 or batch-invariant model attends per query after the prefill (see
        # quantize.py), where the caller needs each token scored as alone; a float one also runs
        # its linears in fixed-size calls then. The prefill itself is the same in every mode.
        invariant = attention.batch_invariant and (self.quantized is not None or self.fixed_rows is not None)
        plan = plan_attention(attention, positions, cache, windows, per_query=invariant)
        after_prefill = any(cache.lengths[segment.row] > 0 for segment in attention.segments)
        fixed_rows = self.fixed_rows if invariant and after_prefill else None
        x = self.embed(tokens)
        count = x.shape[0]
        if fixed_rows is not None:  # the whole stack runs on a multiple of fixed_rows rows
            padding = (0, 0, 0, -count % fixed_rows)
            x, cos, sin = F.pad(x, padding), F.pad(cos, padding), F.pad(sin, padding)
        check_hidden_layers(hidden_layers, len(self.layers))
        stacked = None if self.layer_stack is None or fixed_rows is not None else \
            self.layer_stack(x, cos, sin, plan, cache, hidden_layers)
        if stacked is not None:
            x, outputs = stacked
        else:
            outputs = {}
            for index, (layer, rope) in enumerate(zip(self.layers, self.rope_index, strict=True)):
                x = layer(x, None if rope is None else cos[rope], None if rope is None else sin[rope], plan, cache,
                          index, fixed_rows)
                if index in hidden_layers:
                    outputs[index] = x[:count]
        if not want_logits:
            logits = None
        elif self.norm_then_head is not None:
            logits = self.finish_logits(self.norm_then_head(x)[:count])
        else:
            logits = self.finish_logits(project(self.lm_head, self.norm(x), fixed_rows)[:count])
        hidden = torch.cat([outputs[index] for index in hidden_layers], dim=-1) if hidden_layers else None
        return ForwardOutput(logits, hidden)
