"""The decoder layers of a packed own forward in one compiled call per forward (kernels/stack.cpp):
every layer's q/k/v call, attention and MLP call with no Python between layers. Why: a one-token
forward spent ~4 ms outside the compiled calls on a 28-layer model (three ctypes calls a layer and
the tensors around them), a third of a token on a 135M model (issue 78).

It runs where every layer is a FusedDecoderLayer and the forward's attention is all compiled (chains
over their rows, per-query lists: a prompt, a verify block after it); a forward that needs SDPA
(a padded batch of chains, a masked first tree) takes the per-layer path. Weights and shapes are
handed over once (a ctypes array of StackLayer); a forward passes only what changes (the tokens'
rows, cos/sin, the cache's layers, the plan's chains and query lists). Each layer makes exactly the
per-layer path's calls in its order, so the bits are the same (tests/test_layer_stack.py)."""

from __future__ import annotations

import ctypes
import functools

import torch

from specdec.models.attention import AttentionPlan
from specdec.models.fused_layer import ACTIVATION_CODES, KV_FORMATS, FusedDecoderLayer, library
from specdec.models.paged_cache import OwnCache

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


@functools.lru_cache(maxsize=1)
def _stack_function():
    function = library().specdec_stack
    function.restype = None
    function.argtypes = [POINTER, INT64, POINTER, INT64, INT64, POINTER, POINTER, INT64, POINTER, POINTER, INT64,
                         INT64, INT64, INT64, POINTER, POINTER, POINTER, POINTER, POINTER, POINTER, POINTER, POINTER,
                         POINTER, POINTER, POINTER, POINTER, POINTER]
    return function


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
        _stack_function()(
            ctypes.addressof(self.specs), len(self.layers), x.data_ptr(), count, x.shape[1], cos.data_ptr(),
            sin.data_ptr(), cos.shape[2], pointers(keys_of), pointers(values_of), cache.row_stride, head_stride,
            KV_FORMATS[keys_of[0].dtype], len(chains), chain_rows.data_ptr(), pointers(chain_slot_lists),
            pointers([queries.tokens for queries in lists]), pointers([queries.rows for queries in lists]),
            pointers([queries.slots for queries in lists]), pointers([queries.counts for queries in lists]),
            list_strides.data_ptr(), list_counts.data_ptr(), hidden_at.data_ptr(), hidden_out.data_ptr(),
            qkv.data_ptr(), attended.data_ptr(), out.data_ptr())
        return x, {layer_index: hidden_out[position] for position, layer_index in enumerate(hidden_layers)}
