"""A preallocated KV cache with a batch of rows, indexed by slot (as in gpt-fast), with per-row
lengths and explicit verbs (as in nanochat's engine).

Row r's slots 0..lengths[r]-1 hold its committed context, in position order. A forward writes
its new tokens at the slots just past the committed length; the engine then keeps what the
target accepted: ``commit(row, n)`` keeps the first n new slots (a chain), ``compact(row,
keep)`` moves the kept slots of a tree's accepted path into place, ``rollback(row, length)``
forgets everything from length on. Nothing is freed or reallocated: slots past a row's length
are garbage that the next forward overwrites.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence

import torch


class SlotVerbs:
    """The verbs both caches share (KVCache, paged_cache.PagedKVCache), over ``locate`` (a row's
    logical slots in storage), ``slots_held(row)`` (how many slots a row may write) and
    ``_trim(row)`` (what goes once a row's length shrinks or its writes are settled)."""

    lengths: list[int]
    keys: torch.Tensor  # [layers, storage rows, kv_heads, storage slots, head_dim]
    values: torch.Tensor

    def locate(self, rows: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def prefix(self, layer: int, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def slots_held(self, row: int) -> int:
        raise NotImplementedError

    def _trim(self, row: int) -> None:
        """Nothing by default: a row's slots are its own for good."""

    def _row_slots(self, row: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.keys.device
        return self.locate(torch.full((end - start,), row, device=device), torch.arange(start, end, device=device))

    def write(
        self,
        layer: int,
        row: int,
        keys: torch.Tensor,  # [kv_heads, k, head_dim]
        values: torch.Tensor,  # [kv_heads, k, head_dim]
        offset: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [kv_heads, length + offset + k, head_dim]
        """Store k new tokens' keys and values ``offset`` slots past row's committed length
        (uncommitted), and return every slot up to them."""
        start = self.lengths[row] + offset
        end = start + keys.shape[1]
        if end > self.slots_held(row):
            raise RuntimeError(f"KV cache row {row} holds {self.slots_held(row)} slots, {end} needed; call ensure() "
                               "first")
        rows, slots = self._row_slots(row, start, end)
        # .to(): a 16-bit cache stores them rounded (an indexed put does not cast by itself)
        self.keys[layer][rows, :, slots] = keys.transpose(0, 1).to(self.keys.dtype)
        self.values[layer][rows, :, slots] = values.transpose(0, 1).to(self.values.dtype)
        return self.prefix(layer, row, end)

    def commit(self, row: int, count: int) -> None:
        """Keep the first ``count`` slots written past row's length."""
        if not 0 <= count <= self.slots_held(row) - self.lengths[row]:
            raise ValueError(f"cannot commit {count} slots to row {row} of length {self.lengths[row]}")
        self.lengths[row] += count
        self._trim(row)

    def rollback(self, row: int, length: int) -> None:
        """Forget row's slots from ``length`` on."""
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"cannot roll row {row} of length {self.lengths[row]} back to {length}")
        self.lengths[row] = length
        self._trim(row)

    def check_fork(self, source: int, row: int, length: int) -> None:
        if row == source or not 0 <= length <= self.lengths[source]:
            raise ValueError(f"cannot fork {length} slots of row {source} (length {self.lengths[source]}) "
                             f"into row {row}")

    def compact(self, row: int, keep: Sequence[int]) -> None:
        """Keep the new slots ``keep`` (offsets past row's length, increasing: an accepted tree
        path), moved into place right after the committed context, and commit them."""
        start = self.lengths[row]
        if (any(b <= a for a, b in itertools.pairwise(keep))
                or (keep and (keep[0] < 0 or start + keep[-1] >= self.slots_held(row)))):
            raise ValueError(f"compact needs increasing offsets of written slots, got {list(keep)}")
        moved = [i for i, offset in enumerate(keep) if offset != i]
        if moved:  # offsets increase, so every source lies at or after its destination: gather first
            device = self.keys.device
            rows = torch.full((len(moved),), row, device=device)
            storage_rows, source = self.locate(rows, torch.tensor([start + keep[i] for i in moved], device=device))
            _, target = self.locate(rows, torch.tensor([start + i for i in moved], device=device))
            self.keys[:, storage_rows, :, target] = self.keys[:, storage_rows, :, source]
            self.values[:, storage_rows, :, target] = self.values[:, storage_rows, :, source]
        self.lengths[row] = start + len(keep)
        self._trim(row)


class KVCache(SlotVerbs):
    paged = False  # each row a whole tensor row (PagedKVCache: rows of blocks in one pool)

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_length: int,
        dtype: torch.dtype,
        device: torch.device | str,
        rows: int = 1,
        initial_capacity: int = 256,
    ) -> None:
        if rows < 1:
            raise ValueError(f"a cache needs at least one row, got {rows}")
        self.max_length = max_length
        self.rows = rows
        self.lengths = [0] * rows
        self._shape = (num_layers, rows, num_kv_heads, 0, head_dim)
        self._dtype, self._device = dtype, torch.device(device)
        self.keys = self.values = torch.empty(self._shape, dtype=dtype, device=self._device)
        self.reserve(min(initial_capacity, max_length))

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    def reserve(self, capacity: int) -> None:
        """Make room for ``capacity`` slots in every row. Engines call this once per generation
        with the longest length they can reach, so the decoding loop itself never allocates."""
        capacity = min(capacity, self.max_length)
        if capacity <= self.capacity:
            return
        # Grow geometrically so that callers who do not reserve still pay O(log n) copies.
        capacity = min(max(capacity, 2 * self.capacity), self.max_length)
        layers, rows, heads, _, head_dim = self._shape
        # Zeros, not empty: a padded batch attends (masked) over other rows' unused slots, and
        # uninitialised memory can hold NaN, which a mask does not remove (NaN * 0 = NaN).
        keys = torch.zeros((layers, rows, heads, capacity, head_dim), dtype=self._dtype, device=self._device)
        values = torch.zeros_like(keys)
        used = max(self.lengths)
        keys[..., :used, :] = self.keys[..., :used, :]
        values[..., :used, :] = self.values[..., :used, :]
        self.keys, self.values = keys, values

    @property
    def bytes_per_token(self) -> int:
        """What one slot of one row costs: keys and values of every layer."""
        layers, _, heads, _, head_dim = self._shape
        return 2 * layers * heads * head_dim * torch.empty((), dtype=self._dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def add_rows(self, count: int) -> None:
        """``count`` more rows, empty (a cache whose rows follow requests that come and go)."""
        layers, _, heads, _, head_dim = self._shape
        empty = torch.zeros((layers, count, heads, self.capacity, head_dim), dtype=self._dtype, device=self._device)
        self.keys, self.values = torch.cat([self.keys, empty], dim=1), torch.cat([self.values, empty], dim=1)
        self.rows += count
        self.lengths += [0] * count
        self._shape = (layers, self.rows, heads, 0, head_dim)

    def ensure(self, row: int, length: int) -> None:
        """Room for row's slots up to ``length`` (here: every row's, see reserve)."""
        self.reserve(length)

    @property
    def row_stride(self) -> int:
        """Elements from one row to the next in a layer's keys (the compiled attention's row stride)."""
        return self.keys.stride(1)

    def locate(self, rows: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Storage (row, slot) of logical ones: here the same (a paged cache maps them)."""
        return rows, slots

    def prefix(self, layer: int, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row's slots 0..length-1 of one layer: 2 x [kv_heads, length, d], views."""
        return self.keys[layer, row, :, :length], self.values[layer, row, :, :length]

    def slots_held(self, row: int) -> int:
        return self.capacity

    def fork(self, source: int, row: int, length: int) -> None:
        """Row ``row`` becomes a copy of ``source``'s first ``length`` slots (a shared prompt,
        decoded two ways): a copy, so neither row's later writes reach the other."""
        self.check_fork(source, row, length)
        self.keys[:, row, :, :length] = self.keys[:, source, :, :length]
        self.values[:, row, :, :length] = self.values[:, source, :, :length]
        self.lengths[row] = length


class RowPool:
    """The rows of one cache lent to owners that come and go (a drafter's per-request states):
    a row is free again once its owner is garbage, and the cache doubles its rows when none is.
    One cache for all a drafter's requests is what lets one forward serve them all at once."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.free_rows = list(range(cache.rows))

    def lend(self, owner: object) -> int:
        """A free row, emptied, that comes back when ``owner`` is collected."""
        if not self.free_rows:  # extended in place: the finalizers append to this very list
            self.free_rows.extend(range(self.cache.rows, 2 * self.cache.rows))
            self.cache.add_rows(self.cache.rows)
        row = self.free_rows.pop()
        self.cache.rollback(row, 0)
        weakref.finalize(owner, self.free_rows.append, row)
        return row
