"""A decoder layer of packed linears (int4 or w8a32) in three compiled calls (kernels/layer_ops.cpp and
kernels/attention.cpp, in the library native.py builds), not ~20 torch ops: FusedDecoderLayer, which
precisions.quantize_model swaps in for each DecoderLayer whose four linears share a packed format,
where the self-check passes on this machine.

Why: a one-token int4 step spent ~40% of its time in the small ops around its matmuls (RMSNorm,
attention's cache writes and one-query SDPA calls, RoPE's rotate): per-op dispatch and threading
on vectors of a few thousand floats (measured: docs/design.md, "Correct and fast on every CPU";
docs/benchmarks/archive/notebook.md, "The int4 layer compiled"). Here each layer is: norm + q/k/v
matmul + bias + RoPE (one call), attention (a verify block's per-query segments in one call, a
prompt's chain in another; a padded batch of chains, or a sliding window's or a first tree's masks,
still run SDPA), and o matmul + residual + norm + gate/up matmul + SiLU gate + down matmul +
residual (one call).

Exactness: each row is computed by the same code alone or in any block (layer_ops.cpp,
attention.cpp), and each query attends over exactly its own keys; so the greedy-equality invariant
holds as before. The results are close to, not the same bits as, the torch layer (other summation
orders): check_layer compares them at load, once per machine, with row invariance, and a failure
keeps the torch layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, cast

import torch
from torch import nn

import specdec.models.native as native
from specdec.models.attention import AttentionPlan, QueryList, attend_planned, attend_segments, query_list
from specdec.models.int4 import Int4Linear, PackedLinear
from specdec.models.paged_cache import OwnCache
from specdec.models.primitives import AttendingLayer, RMSNorm, scaled_dot_product
from specdec.models.transformer import DecoderLayer, TransformerConfig
from specdec.models.w8a32 import W8A32Linear

# The cache dtypes the compiled attention stores and reads, as its kv_format argument.
KV_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# The MLP activations the compiled layer runs, as specdec_layer_mlp's activation argument.
ACTIVATION_CODES = {"silu": 0, "gelu_tanh": 1}


class FusedDecoderLayer(nn.Module):
    """A DecoderLayer whose linears share a packed format, run as three compiled calls; the same
    weights (the same modules, under the same names) and the same forward signature. Every
    family's variant is an argument of the calls: q/k norms, norms on the outputs, no input norms,
    GELU, the attention scale, a layer without RoPE."""

    def __init__(self, layer: DecoderLayer) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
        self.window, self.attention_scale, self.softcap = layer.window, layer.attention_scale, layer.softcap
        self.hidden_act, self.rotary, self.eps = layer.hidden_act, layer.rotary, layer.eps
        self.input_norm, self.post_attention_norm = layer.input_norm, layer.post_attention_norm
        self.attention_out_norm, self.mlp_out_norm = layer.attention_out_norm, layer.mlp_out_norm
        self.q_norm: RMSNorm | None = getattr(layer, "q_norm", None)
        self.k_norm: RMSNorm | None = getattr(layer, "k_norm", None)
        linears = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        if not all(isinstance(linear, PackedLinear) for linear in linears):
            raise ValueError("a fused layer needs packed linears (int4 or w8a32)")
        self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj = cast(tuple[PackedLinear, ...], linears)

    def forward(
        self,
        x: torch.Tensor,  # [n, hidden], every segment's new tokens
        cos: torch.Tensor | None,  # [n, head_dim]; None: a layer without RoPE
        sin: torch.Tensor | None,  # [n, head_dim]
        plan: AttentionPlan,
        cache: OwnCache,
        layer_index: int,
        fixed_rows: int | None = None,  # unused: each row is computed alone in any block (layer_ops.cpp)
    ) -> torch.Tensor:  # [n, hidden]
        qkv = qkv_projection(self, x, cos, sin).transpose(0, 1)  # [heads + 2 kv_heads, n, d]
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=0)
        return mlp_block(self, x, attend_compiled(self, q, k, v, plan, cache, layer_index))


def attend_compiled(
    layer: AttendingLayer,  # a FusedDecoderLayer or a draft head's layer
    q: torch.Tensor,  # [heads, n, d], rope applied; q, k and v: views of one token-major buffer
    k: torch.Tensor,  # [kv_heads, n, d], rope applied
    v: torch.Tensor,  # [kv_heads, n, d]
    plan: AttentionPlan,
    cache: OwnCache,
    layer_index: int,
) -> torch.Tensor:  # [n, heads * d]
    """attend_planned, with the per-query tokens in one compiled call and each chain over its whole
    row (a prompt) in another (each writes its keys and values itself), instead of SDPA calls: so
    a prompt's tokens get the bits they would get one by one, in a verify block or alone."""
    if plan.padded is not None:  # a batch of chains in one padded SDPA call per layer
        return attend_planned(layer, q, k, v, plan, cache, layer_index)
    num_tokens = q.shape[1]
    out = q.new_zeros(num_tokens, q.shape[0], q.shape[2])  # [n, heads, d]; padding rows stay zero
    keys, values = cache.keys[layer_index], cache.values[layer_index]
    masked = [segment for segment in plan.masked_segments if segment.chain_after is None]
    attend_segments(layer, q, k, v, masked, cache, layer_index, out.transpose(0, 1))
    for segment in plan.masked_segments:
        if segment.chain_after is not None:
            row, slots = plan.chain_slots(segment)
            attend_chain(layer, q, k, v, segment.start, segment.end - segment.start, segment.chain_after, slots,
                         keys, values, out, row * cache.row_stride)
    if plan.groups:
        attend_queries(layer, q, k, v, plan.query_list_for(layer.window), keys, values, out, cache.row_stride)
    return out.reshape(num_tokens, -1)


@dataclass(frozen=True)
class FusedOutput:
    """The final norm and a packed output head in one compiled call: lm_head(norm(x))."""

    norm: RMSNorm
    head: PackedLinear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        return norm_then_linear(self.norm, self.head, x)


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def attend_queries(
    layer: AttendingLayer,
    q: torch.Tensor,  # [heads, n, d], rope applied
    k: torch.Tensor,  # [kv_heads, n, d], rope applied; q, k and v: views of one buffer (qkv_projection)
    v: torch.Tensor,  # [kv_heads, n, d]
    queries: QueryList,
    keys: torch.Tensor,  # [rows, kv_heads, capacity, d] float32, bfloat16 or float16, one layer's cache: each
    values: torch.Tensor,  # same                      query's key is written into its last slot first
    out: torch.Tensor,  # [n, heads, d] contiguous, written at queries.tokens
    row_stride: int | None = None,  # elements between cache rows (default: keys.stride(0); a paged pool: 0)
) -> None:
    """Each query over exactly its own key slots (attention.cpp, specdec_attend)."""
    d = layer.head_dim
    check_layout(q, k, v, keys, values, out)
    native.library().specdec_attend(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(1), keys.data_ptr(), values.data_ptr(),
        keys.stride(0) if row_stride is None else row_stride,
        keys.stride(1), queries.tokens.data_ptr(), queries.rows.data_ptr(), queries.slots.data_ptr(),
        queries.counts.data_ptr(), queries.slots.stride(0), queries.tokens.shape[0], layer.num_heads,
        layer.num_kv_heads, d, layer.attention_scale, out.data_ptr(), KV_FORMATS[keys.dtype], layer.softcap or 0.0,
    )


def attend_chain(
    layer: AttendingLayer,
    q: torch.Tensor,  # [heads, n, d], rope applied
    k: torch.Tensor,  # [kv_heads, n, d], rope applied; q, k and v: views of one buffer (qkv_projection)
    v: torch.Tensor,  # [kv_heads, n, d]
    first: int,  # the chain: tokens first..first + count - 1 of the forward
    count: int,
    committed: int,  # its row's length before it
    slots: torch.Tensor,  # [committed + count] int64, the row's slots 0.. in storage
    keys: torch.Tensor,  # [rows, kv_heads, capacity, d], one layer's cache (as attend_queries)
    values: torch.Tensor,
    out: torch.Tensor,  # [n, heads, d] contiguous, written at the chain's tokens
    row_base: int,  # elements from the cache's start to the chain's row (row * row stride)
) -> None:
    """Token first + i over its row's slots 0..committed + i, after writing the chain's keys and
    values: the bits attend_queries gives it with that slot list (attention.cpp,
    specdec_attend_chain), without a list per query."""
    check_layout(q, k, v, keys, values, out)
    if slots.dtype != torch.int64 or not slots.is_contiguous() or slots.shape[0] != committed + count:
        raise ValueError(f"attend_chain needs the row's {committed + count} slots, contiguous int64")
    d = layer.head_dim
    native.library().specdec_attend_chain(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(1), keys.data_ptr(), values.data_ptr(), row_base,
        keys.stride(1), slots.data_ptr(), committed, first, count, layer.num_heads, layer.num_kv_heads, d,
        layer.attention_scale, out.data_ptr(), KV_FORMATS[keys.dtype], layer.softcap or 0.0,
    )


def check_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 out: torch.Tensor) -> None:
    """What the compiled attention reads: q, k and v as head views of one token-major buffer, a
    contiguous cache of a stored format and a contiguous output."""
    d = q.shape[2]
    if any(t.stride(2) != 1 or t.stride(0) != d or t.stride(1) != q.stride(1) for t in (q, k, v)) or \
            not (keys.is_contiguous() and values.is_contiguous() and out.is_contiguous()):
        raise ValueError("the compiled attention needs q, k and v as head views of one token-major buffer and a "
                         "contiguous cache")
    if keys.dtype not in KV_FORMATS or values.dtype != keys.dtype:
        raise ValueError(f"the compiled attention reads a float32, bfloat16 or float16 cache, not {keys.dtype}")


def packed_format(layer: DecoderLayer) -> int | None:
    """The packed layout (4: int4, 8: w8a32) the layer's four linears all share, what the compiled
    calls read; None if they do not share one."""
    linears = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
    formats = {linear.format if isinstance(linear, PackedLinear) else None for linear in linears}
    return formats.pop() if len(formats) == 1 else None


def qkv_projection(layer: FusedDecoderLayer, x: torch.Tensor, cos: torch.Tensor | None,
                   sin: torch.Tensor | None) -> torch.Tensor:
    """x [n, hidden] -> [norm], q/k/v matmul, bias, [q/k norms], [RoPE on q and k]:
    [n, heads + 2 kv_heads, d] (a view)."""
    linear, norm = layer.qkv_proj, layer.input_norm
    q_norm, k_norm = layer.q_norm, layer.k_norm
    x = x.contiguous()
    cos, sin = (None, None) if cos is None or sin is None else (cos.contiguous(), sin.contiguous())
    out = torch.empty(x.shape[0], linear.out_padded)
    native.library().specdec_layer_qkv(
        linear.format, x.data_ptr(), _pointer(None if norm is None else norm.weight), layer.eps,
        linear.records.data_ptr(), _pointer(linear.bias), _pointer(None if q_norm is None else q_norm.weight),
        _pointer(None if k_norm is None else k_norm.weight), 0 if q_norm is None else q_norm.weight.shape[0],
        0 if k_norm is None else k_norm.weight.shape[0], _pointer(cos), _pointer(sin), out.data_ptr(), x.shape[0],
        linear.out_padded, linear.in_features, linear.out_features, layer.num_heads, layer.num_kv_heads,
        layer.head_dim, layer.rotary,
    )
    return out[:, : linear.out_features].view(x.shape[0], -1, layer.head_dim)


def head_qkv_projection(linear: PackedLinear, embed_norm: RMSNorm, feature_norm: RMSNorm, embeds: torch.Tensor,
                        features: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_heads: int,
                        head_dim: int) -> torch.Tensor:
    """A draft head's attention input in one call: concat(norm(embeds), norm(features)) [n, 2 hidden],
    its q/k/v matmul, RoPE on q and k: [n, heads + 2 kv_heads, d] (a view)."""
    embeds, features, cos, sin = embeds.contiguous(), features.contiguous(), cos.contiguous(), sin.contiguous()
    out = torch.empty(embeds.shape[0], linear.out_padded)
    native.library().specdec_head_qkv(
        linear.format, embeds.data_ptr(), embed_norm.weight.data_ptr(), features.data_ptr(),
        feature_norm.weight.data_ptr(), embed_norm.eps, linear.records.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        out.data_ptr(), embeds.shape[0], linear.out_padded, embeds.shape[1], rope_heads, head_dim,
    )
    return out[:, : linear.out_features].view(embeds.shape[0], -1, head_dim)


class PackedMLP(Protocol):
    """What mlp_block reads: a FusedDecoderLayer, or a draft head's layer (drafting/fused_head.py)."""

    o_proj: PackedLinear
    gate_up_proj: PackedLinear
    down_proj: PackedLinear

    @property
    def post_attention_norm(self) -> RMSNorm | None: ...  # the MLP's input norm
    @property
    def attention_out_norm(self) -> RMSNorm | None: ...  # norms on attention's and the MLP's outputs (gemma, olmo2)
    @property
    def mlp_out_norm(self) -> RMSNorm | None: ...
    @property
    def hidden_act(self) -> str: ...
    @property
    def eps(self) -> float: ...  # the epsilon of all its norms


def mlp_block(layer: PackedMLP, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """x + [norm](o(attended)), then + [norm](down(act(gate) * up)) of its [norm]: [n, hidden]."""
    o, gate_up, down = layer.o_proj, layer.gate_up_proj, layer.down_proj
    norms = (layer.attention_out_norm, layer.post_attention_norm, layer.mlp_out_norm)
    o_norm, norm, down_norm = (None if norm is None else norm.weight for norm in norms)
    x, attended = x.contiguous(), attended.contiguous()
    out = torch.empty_like(x)
    native.library().specdec_layer_mlp(
        o.format, x.data_ptr(), attended.data_ptr(), o.records.data_ptr(), _pointer(o.bias), _pointer(o_norm),
        _pointer(norm), layer.eps, gate_up.records.data_ptr(), _pointer(gate_up.bias), down.records.data_ptr(),
        _pointer(down.bias), _pointer(down_norm), ACTIVATION_CODES[layer.hidden_act], out.data_ptr(), x.shape[0],
        x.shape[1], attended.shape[1], down.in_features, o.out_padded, gate_up.out_padded,
    )
    return out


def norm_then_linear(norm: RMSNorm, linear: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    """linear(norm(x)) in one call: the final norm and the output head. [n, out_features]"""
    x = x.contiguous()
    out = torch.empty(x.shape[0], linear.out_padded)
    native.library().specdec_norm_linear(
        linear.format, x.data_ptr(), norm.weight.data_ptr(), norm.eps, linear.records.data_ptr(), _pointer(linear.bias),
        out.data_ptr(), x.shape[0], linear.out_padded, linear.in_features, linear.out_features,
    )
    return out[:, : linear.out_features]


def layer_problem(format: int = 4) -> str | None:
    """None if the compiled layer on linears of ``format`` (4: int4, 8: w8a32) matches the torch
    layer closely and scores every row of a block as alone, on this machine (check_layer, cached per
    machine and library), else why not."""
    return native.library_check("layer" + ("" if format == 4 else f":w{format}"), lambda: check_layer(0, format))


# The layer variants the load-time self-check runs: the Llama layer with qwen2's biases, gemma3's
# (per-head q/k norms, norms on the outputs, GELU, a scale of its own), olmo2's (no input norms,
# q/k norms over all heads), phi3's partial rotary (RoPE on 12 of 16 dims) and gemma2's soft-capped
# attention scores.
CHECKED_VARIANTS: dict[str, dict] = {
    "qwen2": dict(attention_bias=True),
    "gemma3": dict(qk_norm="head", post_norms=True, hidden_act="gelu_tanh", attention_scale=0.3),
    "olmo2": dict(qk_norm="projection", pre_norms=False, post_norms=True),
    "phi3-partial-rotary": dict(rotary_dim=12),
    "gemma2": dict(post_norms=True, hidden_act="gelu_tanh", attention_scale=0.3, attention_softcap=1.5),
}


def random_layers(generator: torch.Generator, packed: type[Int4Linear] | type[W8A32Linear],
                  **variant) -> tuple[DecoderLayer, FusedDecoderLayer]:
    """A small layer (4 heads over 2 kv heads of 16; ``variant``: TransformerConfig fields) with
    random packed weights (int4 or w8a32) and norm scales: the torch layer and its compiled twin,
    sharing every module."""
    shape = dict(model_type="qwen2", vocab_size=1, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
                 num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=False,
                 attention_bias=False, output_bias=False, mlp_bias=False, sliding_windows=(None,))
    config = TransformerConfig(**{**shape, **variant})
    layer = DecoderLayer(config, None)
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        dense = getattr(layer, name)
        for parameter in dense.parameters():
            parameter.data = torch.randn(parameter.shape, generator=generator) * 0.3
        setattr(layer, name, packed.of(dense))
    for module in layer.modules():
        if isinstance(module, RMSNorm):
            module.weight.data = 1 + 0.3 * torch.randn(module.weight.shape, generator=generator)
    return layer, FusedDecoderLayer(layer)


def check_layer(seed: int = 0, format: int = 4) -> str | None:
    """check_variant for every layer variant in CHECKED_VARIANTS: None if all pass, else the first
    problem, naming its variant."""
    for name, variant in CHECKED_VARIANTS.items():
        problem = check_variant(seed, format, variant)
        if problem is not None:
            return f"{problem} ({name} layer)"
    return None


def check_variant(seed: int, format: int, variant: dict) -> str | None:
    """A small random layer of packed linears (format 4: int4, 8: w8a32; ``variant``: its config)
    after a random cached context: None if each compiled piece is within float32 rounding of the
    torch layer's own methods on a 3-token chain block, and every row of the block gets the bits it
    gets alone (and as a chain, a prompt's attention), else what differs."""
    generator = torch.Generator().manual_seed(seed)
    reference, layer = random_layers(generator, Int4Linear if format == 4 else W8A32Linear, **variant)
    context, block = 21, 3
    keys = torch.randn(1, 2, 32, 16, generator=generator)
    values = torch.randn(1, 2, 32, 16, generator=generator)
    x = torch.randn(block, 64, generator=generator) * 2
    frequencies = torch.rand(reference.rotary // 2, generator=generator)
    angles = torch.arange(context, context + block)[:, None] * frequencies[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def close(compiled: torch.Tensor, expected: torch.Tensor, what: str) -> str | None:
        error = ((compiled - expected).abs().max() / expected.abs().max().clamp(min=1e-6)).item()
        return None if error < 1e-4 else f"{what} off by {error:.2g} (relative) from the torch layer"

    def rows_alone(what: str, function, *inputs: torch.Tensor) -> str | None:
        together = function(*inputs)
        alone = torch.cat([function(*(tensor[row:row + 1] for tensor in inputs)) for row in range(block)])
        return None if torch.equal(together, alone) else f"{what}: a block's rows differ from them alone"

    qkv = qkv_projection(layer, x, cos, sin)
    expected_qkv = torch.cat(reference.queries_keys_values(x, cos, sin), dim=0).transpose(0, 1)  # [n, heads, d]
    queries, new_keys, new_values = qkv.transpose(0, 1).split([4, 2, 2])  # [heads, n, d]
    lists = query_list(list(range(block)), [0] * block, [torch.arange(context + i + 1) for i in range(block)])
    chain_keys, chain_values, as_chain = keys.clone(), values.clone(), torch.zeros(block, 4, 16)
    attend_chain(layer, queries, new_keys, new_values, 0, block, context, torch.arange(context + block), chain_keys,
                 chain_values, as_chain, 0)
    attended = torch.zeros(block, 4, 16)
    attend_queries(layer, queries, new_keys, new_values, lists, keys, values, attended)
    written = (keys[0, :, context:context + block], values[0, :, context:context + block])
    alone = torch.zeros(block, 4, 16)
    for row in range(block):
        single = query_list([row], [0], [lists.slots[row, : row + context + 1]])
        attend_queries(layer, queries, new_keys, new_values, single, keys, values, alone)
    mask = torch.ones(block, context + block, dtype=torch.bool).tril(context)
    expected_attended = scaled_dot_product(layer, queries[None], keys[:, :, : context + block],
                                           values[:, :, : context + block], mask)[0].transpose(0, 1)  # [n, heads, d]
    attended = attended.reshape(block, -1)
    problems = [
        None if torch.equal(written[0], new_keys) and torch.equal(written[1], new_values)
        else "attention: the block's keys and values are not in their cache slots",
        close(qkv, expected_qkv, "norm + q/k/v + RoPE"),
        close(attended.view(block, 4, 16), expected_attended, "attention"),
        None if torch.equal(alone.reshape(block, -1), attended) else "attention: a block's rows differ from them alone",
        None if torch.equal(as_chain.reshape(block, -1), attended) and torch.equal(chain_keys, keys)
        else "attention: a chain's rows differ from them in a block",
        close(mlp_block(layer, x, attended), reference.mlp_residual(x, attended), "o + residual + norm + MLP"),
        rows_alone("norm + q/k/v + RoPE", lambda rows, c, s: qkv_projection(layer, rows, c, s).reshape(len(rows), -1),
                   x, cos, sin),
        rows_alone("o + residual + norm + MLP", lambda rows, a: mlp_block(layer, rows, a), x, attended),
    ]
    return next((problem for problem in problems if problem), None)
