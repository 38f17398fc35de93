"""How a forward attends, worked out once for all layers: per segment (its cache row, chain or
tree masks), each query over its own keys for batch invariance (QueryGroup), or, for a batch of
chains, as padded rows in a single attention call per layer (padded_chains.py).

Why two ways: on a CPU a small model's step is dominated by per-op overhead, and attending row
by row costs a few ops per request per layer; padded rows cost a few ops per layer in all. The
per-segment way stays for a single request (its arithmetic is then exactly what it was alone),
for trees, and for int8 models, where every row must be scored bit-for-bit as alone.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specdec.models.base import Attention, Segment, tree_depths, tree_visibility
from specdec.models.padded_chains import PaddedChains
from specdec.models.paged_cache import OwnCache
from specdec.models.primitives import AttendingLayer, scaled_dot_product


@dataclass
class SegmentPlan:
    """How one segment of a forward attends, worked out once for all layers."""

    row: int
    start: int  # its tokens are the block's start:end
    end: int
    written: int
    masks: dict[int | None, torch.Tensor | None]  # per sliding window (None = full): [k, length + k] or None
    # For batch invariance: per window, the key slots each query sees (attended via QueryGroups).
    per_query: dict[int | None, list[torch.Tensor]] | None = None
    # A chain that sees every key of its row up to each token (no window cuts it): its committed
    # length. The compiled attention attends it in one call (fused_layer.attend_chain), torch with
    # its masks, or, past QUERY_BLOCK tokens (a prompt in one forward), in blocks whose masks are
    # built as it goes (attend_in_blocks), never one [k, length + k].
    chain_after: int | None = None

    @property
    def in_blocks(self) -> bool:
        return self.chain_after is not None and self.end - self.start > QUERY_BLOCK


# Queries of a long chain attended together: a [k, length] mask, and the [heads, k, length]
# scores of SDPA's path with a mask, grow with the square of a prompt fed in one forward (4,096
# tokens took 1.6 GB over the model on the default target); in blocks they grow linearly.
QUERY_BLOCK = 256


def plan_segment(
    segment: Segment, start: int, committed: int, positions: torch.Tensor, windows: set[int | None], per_query: bool,
) -> SegmentPlan:
    """Masks for one segment: the committed context plus its chain prefix or tree ancestors,
    limited to each sliding window. positions: [k] of this segment's tokens."""
    count, length, device = segment.count, committed + segment.count, positions.device
    chain = segment.parents is None
    if per_query:
        # Each query over exactly the keys it sees, in slot order (QueryGroups): each token is
        # scored as it would be alone, whatever else is in the block (see quantize.py). A
        # chain's keys are a contiguous run of slots; a tree node's are its ancestors'.
        if segment.parents is None:  # a chain
            slots = {window: [torch.arange(0 if window is None else max(0, committed + i + 1 - window),
                                           committed + i + 1, device=device) for i in range(count)]
                     for window in windows}
        else:
            masks = segment_masks(segment, committed, positions, windows)
            visible = torch.cat([torch.ones(count, committed, dtype=torch.bool, device=device),
                                 tree_visibility(segment.parents)[segment.written :].to(device)], dim=1)
            slots = {window: [(visible if mask is None else mask)[i].nonzero()[:, 0] for i in range(count)]
                     for window, mask in masks.items()}
        return SegmentPlan(segment.row, start, start + count, segment.written, {}, slots)
    if chain and all(window is None or length <= window for window in windows):
        # The common case, without building a mask per layer kind: one query sees every key;
        # a block sees the committed context and the block up to itself (in blocks, no mask here).
        mask = None if count == 1 or count > QUERY_BLOCK else \
            torch.ones(count, length, dtype=torch.bool, device=device).tril(committed)
        return SegmentPlan(segment.row, start, start + count, 0, dict.fromkeys(windows, mask), chain_after=committed)
    return SegmentPlan(segment.row, start, start + count, segment.written,
                       segment_masks(segment, committed, positions, windows))


def attend_in_blocks(
    layer: AttendingLayer,
    q: torch.Tensor,  # [heads, n, d], the forward's queries
    keys: torch.Tensor,  # [kv_heads, committed + k, d], the segment's row up to its last token
    values: torch.Tensor,
    plan: SegmentPlan,
    attended: torch.Tensor,  # [heads, n, d], written at the segment's tokens
) -> None:
    """A chain's queries in blocks of QUERY_BLOCK, each over the keys up to its last query:
    memory linear in the chain's length."""
    committed = plan.chain_after
    assert committed is not None  # only chains come here
    for first in range(0, plan.end - plan.start, QUERY_BLOCK):
        last = min(first + QUERY_BLOCK, plan.end - plan.start)
        visible = committed + last
        mask = torch.ones(last - first, visible, dtype=torch.bool, device=q.device).tril(committed + first)
        block = slice(plan.start + first, plan.start + last)
        attended[:, block] = scaled_dot_product(layer, q[:, block], keys[:, :visible], values[:, :visible], mask)


def segment_masks(
    segment: Segment, committed: int, positions: torch.Tensor, windows: set[int | None],
) -> dict[int | None, torch.Tensor | None]:  # per window: [k, committed + k] bool, or None = all
    count, device, parents = segment.count, positions.device, segment.parents
    if parents is None:
        new_visible = torch.ones(count, count, dtype=torch.bool, device=device).tril()
    else:  # rows: this forward's nodes; columns: every node of the tree so far
        new_visible = tree_visibility(parents)[segment.written :].to(device)
    visible = torch.cat([torch.ones(count, committed, dtype=torch.bool, device=device), new_visible], dim=1)
    if segment.written and parents is not None:  # (only a tree has earlier nodes: Segment checks)
        # earlier nodes' positions: committed length + depth, as for this forward's
        earlier = torch.tensor(tree_depths(parents)[: segment.written], device=device) + committed
        positions_so_far = torch.cat([earlier, positions])
    else:
        positions_so_far = positions
    key_positions = torch.cat([torch.arange(committed, device=device), positions_so_far])
    masks: dict[int | None, torch.Tensor | None] = {}
    for window in windows:
        mask = visible if window is None else visible & (positions[:, None] - key_positions[None, :] < window)
        # A query that sees every key needs no mask (a faster SDPA path).
        masks[window] = None if bool(mask.all()) else mask
    return masks


QUERY_BUCKET = 32  # a query's keys are padded (masked) to a multiple of this many slots


@dataclass
class QueryGroup:
    """Queries attended one by one, each over its own keys padded to a multiple of QUERY_BUCKET
    (the keys gathered for the group at once). Alone, the same query gets the same padded length,
    so the same kernel call, shape and summation order, whatever else is in the block.
    The padding keys are masked; what they hold (finite: the cache is zero-initialised) adds
    exact zeros."""

    tokens: torch.Tensor  # [b] index of each query among the forward's tokens
    rows: torch.Tensor | None  # [b, 1] its cache row, in storage (cache.locate; None with prefix_of_row)
    slots: torch.Tensor | None  # [b, L] its key slots in storage, padding repeats slot 0 (None with prefix_of_row)
    mask: torch.Tensor  # [b, 1, 1, L] True = a real key
    # (row, L) when every query sees a prefix of one row's slots (a chain, no sliding window):
    # then the keys are a view of slots 0..L-1, shared by the group, not a gathered copy.
    prefix_of_row: tuple[int, int] | None = None

    def attend(
        self,
        layer: AttendingLayer,
        q: torch.Tensor,  # [heads, n, d]
        cache: OwnCache,
        layer_index: int,
        out: torch.Tensor,  # [heads, n, d], written at self.tokens
    ) -> None:
        if self.prefix_of_row is not None:
            row, length = self.prefix_of_row
            shape = (self.tokens.shape[0], -1, length, -1)
            row_keys, row_values = cache.prefix(layer_index, row, length)  # [kv_heads, L, d]
            keys = row_keys.unsqueeze(0).expand(shape)  # [b, kv_heads, L, d]
            values = row_values.unsqueeze(0).expand(shape)
        else:
            keys = cache.keys[layer_index][self.rows, :, self.slots].transpose(1, 2)  # [b, kv_heads, L, d]
            values = cache.values[layer_index][self.rows, :, self.slots].transpose(1, 2)
        queries = q[:, self.tokens].transpose(0, 1).unsqueeze(2)  # [b, heads, 1, d]
        # One SDPA call per query, each of the shape it has alone: torch's CPU flash kernel splits
        # its work by batch size and thread count, so a query inside a batched call can differ in
        # the last bits from the same query alone (measured with 2 threads, torch 2.13 on AVX2:
        # up to 1e-7, enough to flip an int8 rounding and change greedy text 65 tokens later).
        alone = [
            scaled_dot_product(layer, queries[i : i + 1], keys[i : i + 1], values[i : i + 1], self.mask[i : i + 1])
            for i in range(queries.shape[0])
        ]  # each [1, heads, 1, d]
        out[:, self.tokens] = torch.cat(alone)[:, :, 0].transpose(0, 1)


def group_queries(plans: list[SegmentPlan], window: int | None, cache: OwnCache) -> list[QueryGroup]:
    """The per-query segments' queries, grouped by padded key length."""
    by_length: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
    for plan in plans:
        if plan.per_query is not None:
            for token, slots in zip(range(plan.start, plan.end), plan.per_query[window], strict=False):
                padded = -(-slots.shape[0] // QUERY_BUCKET) * QUERY_BUCKET
                by_length.setdefault(padded, []).append((token, plan.row, slots))
    groups = []
    for length, queries in by_length.items():
        device = queries[0][2].device
        tokens = torch.tensor([token for token, _, _ in queries], device=device)
        rows = [row for _, row, _ in queries]
        mask = torch.zeros(len(queries), 1, 1, length, dtype=torch.bool, device=device)
        for index, (_, _, query_slots) in enumerate(queries):
            mask[index, :, :, : query_slots.shape[0]] = True
        # Sorted distinct slots from 0 to count - 1 are exactly 0..count-1: a view suffices.
        if (
            length <= cache.capacity
            and len(set(rows)) == 1
            and all(int(slots[0]) == 0 and int(slots[-1]) == slots.shape[0] - 1 for _, _, slots in queries)
        ):
            groups.append(QueryGroup(tokens, None, None, mask, (rows[0], length)))
            continue
        slots = torch.zeros(len(queries), length, dtype=torch.long, device=device)
        for index, (_, _, query_slots) in enumerate(queries):
            slots[index, : query_slots.shape[0]] = query_slots
        groups.append(QueryGroup(tokens, *cache.locate(torch.tensor(rows, device=device)[:, None], slots), mask))
    return groups


@dataclass
class QueryList:
    """Every per-query token of a forward for one attention window, as the compiled attention reads them."""

    tokens: torch.Tensor  # [b] int64, index among the forward's tokens
    rows: torch.Tensor  # [b] int64, cache row (logical: the compiled attention groups a row's queries)
    slots: torch.Tensor  # [b, longest] int64, its key slots in storage, in order (the first counts[i] are real)
    counts: torch.Tensor  # [b] int64


def query_list(tokens: list[int], rows: list[int], slot_lists: list[torch.Tensor],
               cache: OwnCache | None = None) -> QueryList:
    """The queries' lists of logical slots, located in ``cache``'s storage (None: as given)."""
    counts = [int(slots.shape[0]) for slots in slot_lists]
    slots = torch.zeros(len(slot_lists), max(counts), dtype=torch.int64)
    for index, own in enumerate(slot_lists):
        slots[index, : counts[index]] = own
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
    rows_tensor = as_tensor(rows)
    if cache is not None:
        slots = cache.locate(rows_tensor[:, None], slots)[1]
    return QueryList(as_tensor(tokens), rows_tensor, slots, as_tensor(counts))


@dataclass
class AttentionPlan:
    cache: OwnCache
    segments: list[SegmentPlan]  # used when padded is None
    padded: PaddedChains | None = None
    groups: dict[int | None, list[QueryGroup]] | None = None  # per window: the per-query segments' queries
    query_lists: dict[int | None, QueryList] = field(default_factory=dict)  # built on demand, see query_list_for
    chain_lists: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)  # built on demand, see chain_slots

    @functools.cached_property
    def masked_segments(self) -> list[SegmentPlan]:
        """The segments not attended query by query: with masks (SDPA), or a chain in one compiled call."""
        return [plan for plan in self.segments if plan.per_query is None]

    def chain_slots(self, segment: SegmentPlan) -> tuple[int, torch.Tensor]:
        """A chain segment's cache row in storage and its row's slots 0..end-1 there ([committed +
        count] int64), located once per forward (the compiled chain attention's input)."""
        if segment.start not in self.chain_lists:
            assert segment.chain_after is not None  # only chains come here
            length = segment.chain_after + segment.end - segment.start
            if length > self.cache.slots_held(segment.row):  # (the compiled call writes where it is told)
                raise RuntimeError(f"KV cache row {segment.row} holds {self.cache.slots_held(segment.row)} slots, "
                                   f"{length} needed; call ensure() first")
            rows, slots = self.cache.locate(torch.tensor([segment.row]), torch.arange(length))
            self.chain_lists[segment.start] = (int(rows.reshape(-1)[0]), slots.reshape(-1).contiguous())
        return self.chain_lists[segment.start]

    def query_list_for(self, window: int | None) -> QueryList:
        """The per-query segments' queries for `window` as one list (the compiled attention's input)."""
        if window not in self.query_lists:
            queries = [(token, plan.row, slots) for plan in self.segments if plan.per_query is not None
                       for token, slots in zip(range(plan.start, plan.end), plan.per_query[window], strict=False)]
            tokens, rows, slot_lists = map(list, zip(*queries, strict=False))
            self.query_lists[window] = query_list(tokens, rows, slot_lists, self.cache)
        return self.query_lists[window]


def plan_attention(
    attention: Attention,
    positions: torch.Tensor,
    cache: OwnCache,
    windows: set[int | None],
    per_query: bool,
) -> AttentionPlan:
    """per_query: attend each query over exactly its keys (after each row's prefill)."""
    if len(attention.segments) > 1 and not attention.has_trees and not per_query:
        return AttentionPlan(cache, [], PaddedChains.build(attention, positions, cache, windows))
    offsets = attention.offsets
    plans = [
        plan_segment(
            segment,
            start,
            cache.lengths[segment.row],
            positions[start:end],
            windows,
            per_query=per_query and cache.lengths[segment.row] > 0,
        )
        for segment, start, end in zip(attention.segments, offsets, offsets[1:], strict=False)
    ]
    if not any(plan.per_query is not None for plan in plans):
        return AttentionPlan(cache, plans)
    return AttentionPlan(cache, plans, groups={window: group_queries(plans, window, cache) for window in windows})


def attend_segments(
    layer: AttendingLayer,
    q: torch.Tensor,  # [heads, n, d], rope applied
    k: torch.Tensor,  # [kv_heads, n, d], rope applied
    v: torch.Tensor,  # [kv_heads, n, d]
    segments: list[SegmentPlan],
    cache: OwnCache,
    layer_index: int,
    attended: torch.Tensor,  # [heads, n, d], written at the masked segments' tokens
) -> None:
    """Write each segment's keys and values into its cache row, and attend those planned with
    masks; a per-query segment's queries are left to its QueryGroups (or the compiled attention)."""
    for segment in segments:
        rows = slice(segment.start, segment.end)
        keys, values = cache.write(layer_index, segment.row, k[:, rows], v[:, rows], segment.written)
        if segment.in_blocks:  # a long chain: its queries in blocks (linear memory)
            attend_in_blocks(layer, q, keys, values, segment, attended)
        elif segment.per_query is None:
            attended[:, rows] = scaled_dot_product(layer, q[:, rows], keys, values, segment.masks.get(layer.window))


def attend_planned(
    layer: AttendingLayer,
    q: torch.Tensor,  # [heads, n, d], rope applied
    k: torch.Tensor,  # [kv_heads, n, d], rope applied
    v: torch.Tensor,  # [kv_heads, n, d]
    plan: AttentionPlan,
    cache: OwnCache,
    layer_index: int,
) -> torch.Tensor:  # [n, heads * d]; rows past the planned tokens (padding) are zeros
    """Write the block's keys and values into the cache and attend as the plan says."""
    num_tokens = q.shape[1]
    if plan.padded is not None:
        attended = plan.padded.attend(layer, q, k, v, cache, layer_index)  # [heads, planned tokens, d]
        attended = attended.transpose(0, 1).reshape(attended.shape[1], -1)
        if attended.shape[0] < num_tokens:  # the padding rows' attention output: zeros
            attended = F.pad(attended, (0, 0, 0, num_tokens - attended.shape[0]))
        return attended
    out = q.new_zeros(num_tokens, q.shape[0], q.shape[2])  # [n, heads, d]; padding rows stay zero
    by_head = out.transpose(0, 1)  # [heads, n, d], a view of out
    attend_segments(layer, q, k, v, plan.segments, cache, layer_index, by_head)
    for group in plan.groups[layer.window] if plan.groups else ():
        group.attend(layer, q, cache, layer_index, by_head)
    return out.reshape(num_tokens, -1)
