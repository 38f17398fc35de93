"""A paged KV cache: every row's keys and values in one pool of fixed-size blocks (as vLLM's
paged attention and llama.cpp's unified KV pool), so one long request can use the memory that
many short ones leave free.

Row r's logical slot s lives in block ``tables[r][s // block_size]`` at offset ``s %
block_size``. The pool is one tensor per kind, ``[layers, 1, kv_heads, blocks * block_size, d]``:
the same layout as a one-row KVCache, so every attention path reads it through ``locate`` (logical
row and slot -> storage row and slot) and the compiled attention reads it with a row stride of 0.
Blocks are taken as forwards need them (``ensure``) and given back when no slot of theirs is
committed any more (commit, compact and rollback trim a row's table). ``fork`` shares whole
blocks by reference; a shared block is copied before a row writes into it (copy-on-write), so a
stored prompt or OpenAI's ``n`` choices cost no copy until they diverge.

The pool is allocated at its full size once but not written: untouched pages are not resident
(the OS maps them on first write), so memory grows with the blocks used, and free blocks are
handed out lowest first so that the pages touched are reused.
"""

from __future__ import annotations

import heapq

import torch

from specdec.models.cache import KVCache, SlotVerbs

#: Tokens a block holds. Small enough that a row wastes little (at most a block), large enough
#: that tables stay short (a 32k-token row: 1,024 entries).
BLOCK_SIZE = 32
LOCATED_KEPT = 64  # runs of located slots remembered (PagedKVCache._row_slots)


class CacheFullError(RuntimeError):
    """The pool has no free block left for a row that needs one."""


class PagedKVCache(SlotVerbs):
    paged = True

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_length: int,
        dtype: torch.dtype,
        device: torch.device | str,
        rows: int,
        num_blocks: int,
        block_size: int = BLOCK_SIZE,
        growable: bool = False,
    ) -> None:
        if rows < 1 or num_blocks < 1 or block_size < 1:
            raise ValueError(f"a paged cache needs rows, blocks and a block size >= 1, got {rows}, {num_blocks}, "
                             f"{block_size}")
        self.max_length, self.rows, self.block_size, self.num_blocks = max_length, rows, block_size, num_blocks
        # A dry pool doubles (a copy) instead of raising CacheFullError: for one generation's rows,
        # sized to what they can reach, where a tree's extra nodes must not fail it (a server's is fixed).
        self.growable = growable
        self.lengths = [0] * rows
        # Per row: slots whose blocks stay with it through commits (hold), 0 for none.
        self.held = [0] * rows
        self.tables: list[list[int]] = [[] for _ in range(rows)]
        self.references = [0] * num_blocks  # rows whose tables hold each block
        self.free_blocks = list(range(num_blocks))  # a heap: the lowest first
        self._device = torch.device(device)
        # Empty, each block zeroed when first taken (untouched pages stay off the resident set):
        # padded or masked reads of unused slots must be finite (NaN * 0 = NaN). Block 0, which
        # padding reads, is zeroed now.
        shape = (num_layers, 1, num_kv_heads, num_blocks * block_size, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=self._device)
        self.values = torch.empty(shape, dtype=dtype, device=self._device)
        self.untouched = 0  # blocks from here on were never taken
        # Pool slots of a run of logical slots, by (start, end, the blocks that hold them): every
        # layer of a forward writes and reads the same runs, and locating them anew was ~10% of a
        # busy server's step on the default pair (py-spy, bench-serve at 8 clients).
        self._located: dict[tuple[int, int, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor]] = {}
        self._zero_if_untouched(0)

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Slots any one row may reach (its blocks come from the pool as it grows)."""
        return min(self.max_length, self.num_blocks * self.block_size)

    @property
    def bytes_per_token(self) -> int:
        layers, _, heads, _, head_dim = self.keys.shape
        return 2 * layers * heads * head_dim * self.keys.element_size()

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    @property
    def free_block_count(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def blocks_needed(self, row: int, length: int) -> int:
        """Blocks ``ensure(row, length)`` would take from the pool (new ones and copies of shared ones)."""
        table, first = self.tables[row], self.lengths[row] // self.block_size
        shared = sum(1 for block in table[first : self.blocks_for(length)] if self.references[block] > 1)
        return max(0, self.blocks_for(length) - len(table)) + shared

    # -- blocks --------------------------------------------------------------------------------
    def _take(self) -> int:
        if not self.free_blocks and self.growable:
            self._grow()
        if not self.free_blocks:
            raise CacheFullError(f"the KV cache's {self.num_blocks} blocks of {self.block_size} tokens are all in use")
        block = heapq.heappop(self.free_blocks)
        self.references[block] = 1
        self._zero_if_untouched(block)
        return block

    def _grow(self) -> None:
        old = self.num_blocks
        self.num_blocks *= 2
        for name in ("keys", "values"):
            pool = getattr(self, name)
            grown = torch.empty((*pool.shape[:3], self.num_blocks * self.block_size, pool.shape[4]), dtype=pool.dtype,
                                device=self._device)
            grown[:, :, :, : old * self.block_size] = pool
            setattr(self, name, grown)
        self.references += [0] * old
        for block in range(old, self.num_blocks):
            heapq.heappush(self.free_blocks, block)

    def _zero_if_untouched(self, block: int) -> None:
        if block >= self.untouched:  # the lowest free block first: never taken means the next one
            self.keys[:, :, :, self._span(block)] = 0
            self.values[:, :, :, self._span(block)] = 0
            self.untouched = block + 1

    def _drop(self, block: int) -> None:
        self.references[block] -= 1
        if self.references[block] == 0:
            heapq.heappush(self.free_blocks, block)

    def _trim(self, row: int) -> None:
        """Give back the row's blocks past its committed length (and past what it holds)."""
        table = self.tables[row]
        keep = self.blocks_for(max(self.lengths[row], self.held[row]))
        for block in table[keep:]:
            self._drop(block)
        del table[keep:]

    def _span(self, block: int) -> slice:
        return slice(block * self.block_size, (block + 1) * self.block_size)

    def ensure(self, row: int, length: int) -> None:
        """Blocks for row's slots up to ``length``, and its own copy of any shared block it will
        write (from its committed length on). Raises CacheFullError when the pool runs dry (the
        blocks taken so far stay with the row)."""
        if length > self.max_length:
            raise RuntimeError(f"KV cache rows hold {self.max_length} positions, {length} needed")
        table = self.tables[row]
        for index in range(self.lengths[row] // self.block_size, min(len(table), self.blocks_for(length))):
            if self.references[table[index]] > 1:  # copy-on-write
                copy = self._take()
                self.keys[:, :, :, self._span(copy)] = self.keys[:, :, :, self._span(table[index])]
                self.values[:, :, :, self._span(copy)] = self.values[:, :, :, self._span(table[index])]
                self._drop(table[index])
                table[index] = copy
        while len(table) < self.blocks_for(length):
            table.append(self._take())

    def hold(self, row: int, length: int) -> None:
        """ensure(row, length), and keep those blocks with the row through its commits until
        release_hold (or the row is emptied): a prompt's blocks, taken when it is admitted, so
        that its prefill in pieces never runs dry while other rows grow (a commit gives back the
        blocks past the committed length, which a running request then took)."""
        self.ensure(row, length)
        self.held[row] = length

    def release_hold(self, row: int) -> None:
        """The row's blocks past its committed length go back to the pool (hold's end)."""
        self.held[row] = 0
        self._trim(row)

    def rollback(self, row: int, length: int) -> None:
        """Forget row's slots from ``length`` on; an emptied row holds nothing any more."""
        if length == 0:
            self.held[row] = 0
        super().rollback(row, length)

    def reserve(self, capacity: int) -> None:
        """Nothing: blocks are taken per row as forwards need them (ensure)."""

    # -- where slots live ----------------------------------------------------------------------
    row_stride = 0  # every row is storage row 0 (the compiled attention's row stride)

    def table(self, rows: torch.Tensor) -> torch.Tensor:  # [R] -> [R, longest table]
        """Each row's block table, padded with block 0 (a padded slot reads finite garbage, masked)."""
        tables = [self.tables[row] for row in rows.tolist()]
        width = max(1, max(len(table) for table in tables))
        return torch.tensor([table + [0] * (width - len(table)) for table in tables], dtype=torch.int64,
                            device=self._device)

    def locate(self, rows: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Storage (row, slot) of logical (row, slot) pairs, rows and slots broadcast together
        (e.g. [b, 1] and [b, L]); a slot past its row's table reads block 0 (finite garbage, for
        masked padding)."""
        rows, slots = torch.broadcast_tensors(rows, slots)
        unique, inverse = torch.unique(rows, return_inverse=True)
        tables = self.table(unique)  # [U, width]
        blocks = slots // self.block_size
        blocks = torch.where(blocks < tables.shape[1], blocks, 0)
        physical = tables[inverse, blocks] * self.block_size + slots % self.block_size
        return torch.zeros_like(physical), physical

    def _row_slots(self, row: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """locate() of row's slots start..end-1, remembered while the blocks that hold them are the
        same (the key holds them, so a changed table can never return stale slots)."""
        key = (start, end, tuple(self.tables[row][: self.blocks_for(end)]))
        found = self._located.get(key)
        if found is None:
            if len(self._located) >= LOCATED_KEPT:
                self._located.clear()
            found = self._located[key] = super()._row_slots(row, start, end)
        return found

    def prefix(self, layer: int, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row's slots 0..length-1 of one layer: 2 x [kv_heads, length, d] (a view where its blocks
        are consecutive in the pool, else a gathered copy)."""
        table = self.tables[row][: self.blocks_for(length)]
        if table and table == list(range(table[0], table[0] + len(table))) and len(table) * self.block_size >= length:
            start = table[0] * self.block_size
            return self.keys[layer, 0, :, start : start + length], self.values[layer, 0, :, start : start + length]
        _, slots = self._row_slots(row, 0, length)
        return self.keys[layer, 0].index_select(1, slots), self.values[layer, 0].index_select(1, slots)

    # -- the verbs of a cache ------------------------------------------------------------------
    def slots_held(self, row: int) -> int:
        return len(self.tables[row]) * self.block_size

    def fork(self, source: int, row: int, length: int) -> None:
        """Row ``row`` starts as ``source``'s first ``length`` slots, sharing its blocks (each row
        copies a shared block before writing into it: ensure)."""
        self.check_fork(source, row, length)
        self.rollback(row, 0)
        shared = self.tables[source][: self.blocks_for(length)]
        for block in shared:
            self.references[block] += 1
        self.tables[row] = list(shared)
        self.lengths[row] = length


#: Either of our own caches (what our forward and attention read).
OwnCache = KVCache | PagedKVCache
