"""Several requests' chains attended as padded rows of one attention call per layer (attention.py
says when, and why: fewer ops per layer than one call per request)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.models.base import Attention
from specdec.models.paged_cache import OwnCache
from specdec.models.primitives import AttendingLayer, scaled_dot_product


@dataclass
class PaddedChains:
    """Several chain segments as rows of one padded attention: R rows of up to C new tokens
    (short rows repeat their last query; the copies are dropped), keys up to the longest row."""

    rows: torch.Tensor  # [R] cache rows
    contiguous: bool  # rows are 0..R-1 of an unpaged cache: the cache rows are a view, not a copy
    token_rows: torch.Tensor  # [n] storage row of each new token (cache.locate)
    token_slots: torch.Tensor  # [n] the storage slot it is written to
    # [R, key_length] storage rows and slots of each row's keys, for a paged cache (None: whole rows)
    key_index: tuple[torch.Tensor, torch.Tensor] | None
    gather: torch.Tensor | None  # [R * C] which new token fills each padded query (None: every row has C)
    scatter: torch.Tensor | None  # [n] where each new token's output sits among the R * C (None: all of them)
    key_length: int
    masks: dict[int | None, torch.Tensor | None]  # per window: [R, 1, C, key_length] bool, or None = all

    @staticmethod
    def build(attention: Attention, positions: torch.Tensor, cache: OwnCache,
              windows: set[int | None]) -> PaddedChains:
        device = positions.device
        segments, offsets = attention.segments, attention.offsets
        # Index bookkeeping in Python lists, then one tensor each: a few ops per forward, not per row.
        rows = [s.row for s in segments]
        committed = [cache.lengths[r] for r in rows]
        counts = [s.count for s in segments]
        width = max(counts)
        key_length = max(c + n for c, n in zip(committed, counts, strict=False))
        clamped = [[min(i, n - 1) for i in range(width)] for n in counts]  # padded query -> real query of its row
        gather = [start + i for start, row in zip(offsets, clamped, strict=False) for i in row]
        scatter = [r * width + i for r, n in enumerate(counts) for i in range(n)]
        token_rows = [row for row, n in zip(rows, counts, strict=False) for _ in range(n)]
        token_slots = [c + i for c, n in zip(committed, counts, strict=False) for i in range(n)]
        # [R, C]
        query_slots = torch.tensor([[c + i for i in row] for c, row in zip(committed, clamped, strict=True)],
                                   device=device)
        slots = torch.arange(key_length, device=device)  # [L]
        visible = slots[None, None, :] <= query_slots[:, :, None]  # [R, C, L]
        masks: dict[int | None, torch.Tensor | None] = {}
        for window in windows:
            mask = visible
            if window is not None:
                key_positions = slots.repeat(len(rows), 1)  # [R, L]: committed slots hold positions 0..
                local_rows = [r for r, n in enumerate(counts) for _ in range(n)]
                key_positions[local_rows, token_slots] = positions
                query_positions = positions[gather].view(len(rows), width)
                mask = mask & (query_positions[:, :, None] - key_positions[:, None, :] < window)
            masks[window] = None if bool(mask.all()) else mask[:, None]
        as_tensor = lambda values: torch.tensor(values, device=device)  # noqa: E731
        uniform = all(n == width for n in counts)  # no padding (plain decoding, equal drafts): views suffice
        rows_tensor = as_tensor(rows)
        return PaddedChains(
            rows_tensor,
            not cache.paged and rows == list(range(len(rows))),
            *cache.locate(as_tensor(token_rows), as_tensor(token_slots)),
            cache.locate(rows_tensor[:, None], slots[None, :]) if cache.paged else None,
            None if uniform else as_tensor(gather),
            None if uniform else as_tensor(scatter),
            key_length,
            masks,
        )

    def attend(
        self,
        layer: AttendingLayer,
        q: torch.Tensor,  # [heads, n, d]
        k: torch.Tensor,  # [kv_heads, n, d]
        v: torch.Tensor,  # [kv_heads, n, d]
        cache: OwnCache,
        layer_index: int,
    ) -> torch.Tensor:  # [heads, n, d]
        # .to(): a 16-bit cache stores them rounded (an indexed put does not cast by itself)
        cache.keys[layer_index][self.token_rows, :, self.token_slots] = k.transpose(0, 1).to(cache.keys.dtype)
        cache.values[layer_index][self.token_rows, :, self.token_slots] = v.transpose(0, 1).to(cache.values.dtype)
        if self.key_index is not None:  # [R, L, kv_heads, d] gathered, as [R, kv_heads, L, d]
            keys = cache.keys[layer_index][self.key_index[0], :, self.key_index[1]].transpose(1, 2)
            values = cache.values[layer_index][self.key_index[0], :, self.key_index[1]].transpose(1, 2)
        elif self.contiguous:
            keys = cache.keys[layer_index, : self.rows.shape[0], :, : self.key_length]  # [R, kv_heads, L, d]
            values = cache.values[layer_index, : self.rows.shape[0], :, : self.key_length]
        else:
            keys = cache.keys[layer_index, :, :, : self.key_length].index_select(0, self.rows)
            values = cache.values[layer_index, :, :, : self.key_length].index_select(0, self.rows)
        heads, _, head_dim = q.shape
        padded = q.transpose(0, 1)  # [n, heads, d]
        if self.gather is not None:
            padded = padded.index_select(0, self.gather)
        padded = padded.reshape(self.rows.shape[0], -1, heads, head_dim).transpose(1, 2)  # [R, heads, C, d]
        out = scaled_dot_product(layer, padded, keys, values, self.masks[layer.window])  # [R, heads, C, d]
        out = out.transpose(1, 2).reshape(-1, heads, head_dim)  # [R * C, heads, d]
        if self.scatter is not None:
            out = out.index_select(0, self.scatter)
        return out.transpose(0, 1)
