"""The decoder layers of a packed own forward in one compiled call per forward (kernels/stack.cpp):
every layer's q/k/v call, attention and MLP call with no Python between layers. Why: a one-token
forward spent ~4 ms outside the compiled calls on a 28-layer model (three ctypes calls a layer and
the tensors around them), a third of a token on a 135M model (issue 78).

It runs where every layer is a FusedDecoderLayer and the forward's attention is all compiled (chains
over their rows, per-query lists: a prompt, a verify block after it); a forward that needs SDPA
(a padded batch of chains, a masked first tree) takes the per-layer path. Weights and shapes are
handed over once (a ctypes array of StackLayer); a forward passes only what changes (the tokens'
rows, cos/sin, the cache's layers, the plan's chains and query lists). Each layer makes exactly the
per-layer path's calls in its order, so the bits are the same (tests/test_layer_stack.py); check_stack
proves it again on the machine that runs it, once per compiled library, before a model uses it."""

from __future__ import annotations

import ctypes
import math
from typing import cast

import torch

import specdec.models.native as native
from specdec.models.attention import AttentionPlan
from specdec.models.base import Attention, Segment
from specdec.models.fused_layer import ACTIVATION_CODES, KV_FORMATS, FusedDecoderLayer, FusedOutput
from specdec.models.int4 import Int4Linear
from specdec.models.paged_cache import OwnCache
from specdec.models.transformer import DEFAULT_ROPE, DecoderLayer, LlamaFamilyModel, TransformerConfig
from specdec.models.w8a32 import W8A32Linear

POINTER, INT64, DOUBLE = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double


class StackLayer(ctypes.Structure):
    """One layer's weights and shapes as stack.cpp reads them (every field 8 bytes: no padding)."""

    _fields_ = [("format", INT64), ("input_norm", POINTER), ("qkv_w", POINTER), ("qkv_bias", POINTER),
                ("q_norm", POINTER), ("k_norm", POINTER), ("q_norm_size", INT64), ("k_norm_size", INT64),
                ("qkv_padded", INT64), ("qkv_width", INT64), ("qkv_in", INT64), ("heads", INT64),
                ("kv_heads", INT64), ("d", INT64), ("rotary", INT64), ("rope_table", INT64), ("query_list", INT64),
                ("o_w", POINTER), ("o_bias", POINTER), ("o_norm", POINTER), ("post_norm", POINTER),
                ("gate_up_w", POINTER), ("gate_up_bias", POINTER), ("down_w", POINTER), ("down_bias", POINTER),
                ("down_norm", POINTER), ("activation", INT64), ("inter", INT64), ("hidden_padded", INT64),
                ("gate_up_padded", INT64), ("eps", DOUBLE), ("scale", DOUBLE), ("softcap", DOUBLE)]


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class LayerStack:
    """``stack(x, cos, sin, plan, cache, hidden_layers)`` -> (x after every layer, {layer: its
    output}) in one compiled call, or None where this forward needs the per-layer path."""

    def __init__(self, layers: list[FusedDecoderLayer], rope_index: list[int | None]) -> None:
        self.layers = layers  # (kept: the specs point into their tensors)
        self.windows = list(dict.fromkeys(layer.window for layer in layers))
        self.hidden = layers[0].o_proj.out_features
        self.specs = (StackLayer * len(layers))(*[self._spec(layer, rope) for layer, rope in
                                                 zip(layers, rope_index, strict=True)])

    def _spec(self, layer: FusedDecoderLayer, rope: int | None) -> StackLayer:
        qkv, o, gate_up, down = layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj
        weight = lambda norm: None if norm is None else norm.weight  # noqa: E731
        return StackLayer(
            qkv.format, _pointer(weight(layer.input_norm)), qkv.records.data_ptr(), _pointer(qkv.bias),
            _pointer(weight(layer.q_norm)), _pointer(weight(layer.k_norm)),
            0 if layer.q_norm is None else layer.q_norm.weight.shape[0],
            0 if layer.k_norm is None else layer.k_norm.weight.shape[0], qkv.out_padded, qkv.out_features,
            qkv.in_features, layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.rotary,
            -1 if rope is None else rope, self.windows.index(layer.window), o.records.data_ptr(), _pointer(o.bias),
            _pointer(weight(layer.attention_out_norm)), _pointer(weight(layer.post_attention_norm)),
            gate_up.records.data_ptr(), _pointer(gate_up.bias), down.records.data_ptr(), _pointer(down.bias),
            _pointer(weight(layer.mlp_out_norm)), ACTIVATION_CODES[layer.hidden_act], down.in_features,
            o.out_padded, gate_up.out_padded, layer.eps, layer.attention_scale, layer.softcap or 0.0)

    def __call__(
        self,
        x: torch.Tensor,  # [n, hidden] float32, the embedded tokens
        cos: torch.Tensor,  # [tables, n, rope width]
        sin: torch.Tensor,  # [tables, n, rope width]
        plan: AttentionPlan,
        cache: OwnCache,
        hidden_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]] | None:
        if plan.padded is not None or any(segment.chain_after is None for segment in plan.masked_segments):
            return None  # SDPA's masks: the per-layer path
        keys_of = [cache.keys[index] for index in range(len(self.layers))]
        values_of = [cache.values[index] for index in range(len(self.layers))]
        if keys_of[0].dtype not in KV_FORMATS or not all(t.is_contiguous() for t in keys_of + values_of):
            return None
        count = x.shape[0]
        x = x.contiguous().clone()
        cos, sin = cos.contiguous(), sin.contiguous()
        chains = plan.masked_segments  # (all chains here)
        chain_rows = torch.zeros(max(len(chains), 1), 4, dtype=torch.int64)
        chain_slot_lists = []
        for index, segment in enumerate(chains):
            row, slots = plan.chain_slots(segment)
            committed, length = int(segment.chain_after or 0), segment.end - segment.start
            if slots.dtype != torch.int64 or not slots.is_contiguous() or slots.shape[0] != committed + length:
                raise ValueError(f"attend_chain needs the row's {committed + length} slots, contiguous int64")
            chain_rows[index] = torch.tensor([segment.start, length, committed, row * cache.row_stride])
            chain_slot_lists.append(slots)
        lists = [plan.query_list_for(window) for window in self.windows] if plan.groups else []
        pointers = lambda tensors: (ctypes.c_void_p * max(len(tensors), 1))(  # noqa: E731
            *[tensor.data_ptr() for tensor in tensors])
        list_strides = torch.tensor([queries.slots.stride(0) for queries in lists] or [0] * len(self.windows),
                                    dtype=torch.int64)
        list_counts = torch.tensor([queries.tokens.shape[0] for queries in lists] or [0] * len(self.windows),
                                   dtype=torch.int64)
        hidden_at = torch.full((len(self.layers),), -1, dtype=torch.int64)
        for position, layer_index in enumerate(hidden_layers):
            hidden_at[layer_index] = position
        hidden_out = torch.empty(max(len(hidden_layers), 1), count, self.hidden)
        widest = max(layer.qkv_proj.out_padded for layer in self.layers)
        qkv = torch.empty(count, widest)
        attended = torch.empty(count, max(layer.num_heads * layer.head_dim for layer in self.layers))
        out = torch.empty_like(x)
        head_stride = keys_of[0].stride(1)
        native.library().specdec_stack(
            ctypes.addressof(self.specs), len(self.layers), x.data_ptr(), count, x.shape[1], cos.data_ptr(),
            sin.data_ptr(), cos.shape[2], pointers(keys_of), pointers(values_of), cache.row_stride, head_stride,
            KV_FORMATS[keys_of[0].dtype], len(chains), chain_rows.data_ptr(), pointers(chain_slot_lists),
            pointers([queries.tokens for queries in lists]), pointers([queries.rows for queries in lists]),
            pointers([queries.slots for queries in lists]), pointers([queries.counts for queries in lists]),
            list_strides.data_ptr(), list_counts.data_ptr(), hidden_at.data_ptr(), hidden_out.data_ptr(),
            qkv.data_ptr(), attended.data_ptr(), out.data_ptr())
        return x, {layer_index: hidden_out[position] for position, layer_index in enumerate(hidden_layers)}


def stack_problem(format: int) -> str | None:
    """None if the one call gives the per-layer path's bits on this machine (check_stack, cached per
    machine and compiled library), else why not: the model's layers then run one by one."""
    return native.library_check(f"stack:w{format}", lambda: check_stack(format))


def check_stack(format: int, seed: int = 0) -> str | None:
    """None if a small random model of packed linears (format 4: int4, 8: w8a32; three layers: a
    sliding window, a layer without RoPE) gives, through the one call, every forward's logits and
    hidden states bit for bit as its layers one by one: a prompt in two pieces, a verify chain
    reading two layers' outputs, two rows at once; else what differs."""
    network = _random_network(torch.Generator().manual_seed(seed), format)
    stack = network.layer_stack
    prompts = [[5, 9, 14, 3, 27, 8, 19, 40, 2], [12, 4, 4, 31]]
    # Each forward: (tokens, each token's row, attention, the layers whose outputs it returns).
    steps: list[tuple[list[int], list[int], Attention, tuple[int, ...]]] = [
        (prompts[0][:5], [0] * 5, Attention.chain(5, 0), ()),
        (prompts[0][5:], [0] * 4, Attention.chain(4, 0), ()),
        ([7, 3, 30], [0] * 3, Attention.chain(3, 0), (0, 2)),
        (prompts[1] + [6, 11], [1] * 4 + [0] * 2, Attention((Segment(1, 4), Segment(0, 2))), (1,)),
    ]
    assert stack is not None
    ran: list[bool] = []

    def counted(*arguments):
        stacked = stack(*arguments)
        ran.append(stacked is not None)
        return stacked

    results = []
    for layers in (counted, None):
        network.layer_stack = layers
        cache = network.new_cache(rows=2)
        outputs = []
        for tokens, rows, attention, hidden_layers in steps:
            positions = torch.tensor([int(cache.lengths[row]) + rows[:index].count(row)
                                      for index, row in enumerate(rows)])
            output = network(torch.tensor(tokens), positions, cache, attention, hidden_layers=hidden_layers)
            outputs.append((output.logits, output.hidden))
            for segment in attention.segments:
                cache.commit(segment.row, segment.count)
        results.append(outputs)
    network.layer_stack = stack
    if not all(ran):
        return f"the one call declined forward {ran.index(False) + 1} of {len(ran)}"
    for step, ((logits, hidden), (expected_logits, expected_hidden)) in enumerate(zip(*results, strict=True)):
        if not torch.equal(logits, expected_logits):
            return f"forward {step + 1}: logits differ from the layers one by one"
        if (hidden is None) != (expected_hidden is None) or \
                hidden is not None and not torch.equal(hidden, expected_hidden):
            return f"forward {step + 1}: hidden states differ from the layers one by one"
    return None


def _random_network(generator: torch.Generator, format: int) -> LlamaFamilyModel:
    """check_stack's model: random weights, packed, its layers compiled and in one call."""
    config = TransformerConfig(
        model_type="qwen2", vocab_size=48, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=False,
        attention_bias=True, output_bias=False, mlp_bias=False, sliding_windows=(None, 6, None),
        rope_layers=(DEFAULT_ROPE, None, DEFAULT_ROPE))
    inverse_frequencies = 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16)
    network = LlamaFamilyModel(config, {DEFAULT_ROPE: (inverse_frequencies, 1.0)})
    for parameter in network.parameters():
        parameter.data = torch.randn(parameter.shape, generator=generator) / math.sqrt(parameter.shape[-1])
    for name, parameter in network.named_parameters():
        if name.endswith("norm.weight"):
            parameter.data = 1 + 0.3 * torch.randn(parameter.shape, generator=generator)
    packed: type[Int4Linear] | type[W8A32Linear] = Int4Linear if format == 4 else W8A32Linear
    fused = []
    for layer in cast(list[DecoderLayer], list(network.layers)):
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            setattr(layer, name, packed.of(getattr(layer, name)))
        fused.append(FusedDecoderLayer(layer))
    network.layers = torch.nn.ModuleList(fused)
    head = packed.of(cast(torch.nn.Linear, network.lm_head))
    network.lm_head, network.norm_then_head = head, FusedOutput(network.norm, head)
    network.quantized, network.kv_dtype = "int4" if format == 4 else "w8a32", torch.float16
    network.layer_stack = LayerStack(fused, network.rope_index)
    return network
