"""The paged KV cache (specdec/models/paged_cache.py): every forward through it gives the bits the
contiguous cache gives, token for token (chains, trees, ragged batches, after rollbacks, compactions
and forks), whatever blocks its rows hold; forks share blocks until one writes (copy-on-write)."""

import pytest
import torch
from tiny import save_random_model

from specdec.models.base import Attention, Segment
from specdec.models.cache import KVCache
from specdec.models.loading import load
from specdec.models.paged_cache import CacheFullError, PagedKVCache

# A tree of 10 drafted nodes under the block's first token (index 0): node i + 1's parent.
TREE = (-1, 0, 0, 1, 1, 2, 3, 3, 5, 6, 4)
PATH = [0, 2, 5, 8]  # the root, then a path down the tree (each the child of the one before)


def paged_like(model, rows: int, num_blocks: int = 64, block_size: int = 4) -> PagedKVCache:
    c = model.network.config
    return PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, c.max_position_embeddings,
                        model.network.kv_dtype or model.network.dtype, "cpu", rows, num_blocks, block_size)


def script(model, cache) -> list[torch.Tensor]:
    """The same forwards and cache verbs on any cache; the logits of each forward."""
    generator = torch.Generator().manual_seed(3)
    tokens = lambda count: torch.randint(3, 96, (count,), generator=generator)  # noqa: E731
    outputs = []

    def forward(segments, batch_invariant=True):
        ids = torch.cat([tokens(segment.count) for segment in segments])
        positions = torch.cat([
            torch.arange(cache.lengths[s.row], cache.lengths[s.row] + s.count) if s.parents is None
            else cache.lengths[s.row] + torch.tensor([_depth(s.parents, i) for i in range(s.count)])
            for s in segments])
        out = model.forward(ids, positions, cache, Attention(tuple(segments), batch_invariant)).logits
        outputs.append(out)

    forward([Segment(1, 9)])  # row 1 first: row 0's blocks are then not consecutive in the pool
    forward([Segment(0, 23)])
    cache.commit(1, 9), cache.commit(0, 23)
    forward([Segment(1, 30)])
    cache.commit(1, 30)
    forward([Segment(0, 5), Segment(1, len(TREE), TREE)])  # a chain and a tree, one forward
    cache.commit(0, 3), cache.compact(1, PATH)
    cache.rollback(0, cache.lengths[0] - 2)
    forward([Segment(0, 4), Segment(1, 1)])
    cache.commit(0, 4), cache.commit(1, 1)
    cache.fork(1, 2, cache.lengths[1] - 3)  # a prefix of row 1, then both go on
    forward([Segment(2, 3), Segment(1, 2)])
    cache.commit(2, 3), cache.commit(1, 2)
    forward([Segment(0, 2), Segment(1, 5), Segment(2, 1)], batch_invariant=False)  # padded rows
    cache.commit(0, 2), cache.commit(1, 5), cache.commit(2, 1)
    forward([Segment(2, 6), Segment(0, 1)])
    return outputs


def _depth(parents, index):
    depth = 0
    while parents[index] >= 0:
        index, depth = parents[index], depth + 1
    return depth


@pytest.mark.parametrize("settings", [
    {},  # float32, torch layers
    {"quantize": "int4"},  # the compiled layer and attention, float16 keys and values
    {"quantize": "int4", "kv_dtype": "float32"},
    {"quantize": "w8a32"},
    {"dtype": "bfloat16"},
])
def test_paged_forwards_equal_contiguous_ones_bit_for_bit(model_dir, settings):
    """Mutation checked: locate() ignoring the block table (slot s read at pool slot s) fails every
    case; the compiled attention given a row stride other than 0 fails the compiled ones (int4, w8a32)."""
    folder = save_random_model(model_dir / "paged-qwen2", "qwen2", seed=5)
    model = load(folder, **settings)
    contiguous = script(model, KVCache(*_shape(model), rows=3))
    paged = script(model, paged_like(model, rows=3))
    assert len(contiguous) == len(paged)
    for expected, got in zip(contiguous, paged, strict=True):
        assert torch.equal(expected, got)


def _shape(model):
    c = model.network.config
    return (c.num_layers, c.num_kv_heads, c.head_dim, c.max_position_embeddings,
            model.network.kv_dtype or model.network.dtype, "cpu")


@pytest.mark.parametrize("quantize", [None, "int4"])
def test_the_engine_decodes_a_ragged_batch_through_a_paged_cache_as_through_rows(tiny_pair, quantize):
    """Greedy speculative decoding of prompts of different lengths together: the same tokens
    with the paged cache as with the contiguous one, and as each prompt alone."""
    from specdec.decoder import SpeculativeDecoder

    target = load(tiny_pair["target"], quantize=quantize)
    decoder = SpeculativeDecoder(target, load(tiny_pair["perturbed"]), gamma=4)
    prompts = [list(range(3, 20)), list(range(40, 43)), list(range(5, 60, 2))]
    expected = [result.token_ids for result in decoder.generate(prompts, max_new_tokens=40)]
    target.new_cache = lambda rows=1, max_length=None: target.new_paged_cache(rows, 1024, max_length)
    assert [result.token_ids for result in decoder.generate(prompts, max_new_tokens=40)] == expected
    assert [decoder.generate(prompt, max_new_tokens=40).token_ids for prompt in prompts] == expected


def _cache(num_blocks=8, block_size=4, rows=3):
    return PagedKVCache(1, 1, 2, 64, torch.float32, "cpu", rows, num_blocks, block_size)


def _fill(cache, row, count, value):
    cache.ensure(row, cache.lengths[row] + count)
    cache.write(0, row, torch.full((1, count, 2), value), torch.full((1, count, 2), value))
    cache.commit(row, count)


def test_a_fork_shares_whole_blocks_and_copies_one_only_when_written():
    cache = _cache()
    _fill(cache, 0, 10, 1.0)  # blocks of 4: 3 blocks, the last half full
    assert cache.free_block_count == 5
    cache.fork(0, 1, 10)
    assert cache.free_block_count == 5 and cache.tables[1] == cache.tables[0]  # no copy
    _fill(cache, 1, 1, 2.0)  # row 1 writes into the shared last block: it gets its own
    assert cache.free_block_count == 4
    assert cache.tables[1][:2] == cache.tables[0][:2] and cache.tables[1][2] != cache.tables[0][2]
    keys_0, _ = cache.prefix(0, 0, 10)
    keys_1, _ = cache.prefix(0, 1, 11)
    assert torch.equal(keys_0[0, :, 0], torch.ones(10))
    assert torch.equal(keys_1[0, :, 0], torch.tensor([1.0] * 10 + [2.0]))
    _fill(cache, 0, 1, 3.0)  # row 0's block is its own again: written in place
    assert cache.free_block_count == 4 and cache.prefix(0, 1, 11)[0][0, 10, 0] == 2.0


def test_remembered_slots_follow_the_blocks_that_hold_them():
    """Writes locate a run of slots once and remember it by the blocks holding it: after a
    rollback gives a block back and another row takes it, the same run of slots of the first row
    is written where its new block is, never into the block it held before. Mutation, checked:
    a key without the row's blocks fails it."""
    cache = _cache(num_blocks=4)
    _fill(cache, 0, 6, 1.0)  # blocks of 4: row 0's slots 4-5 in its second block
    cache.rollback(0, 4)
    _fill(cache, 1, 4, 2.0)  # row 1 takes the block row 0 gave back
    _fill(cache, 0, 2, 3.0)  # the same run of row 0, now in another block
    assert cache.tables[0][1] != cache.tables[1][0]
    assert torch.equal(cache.prefix(0, 0, 6)[0][0, :, 0], torch.tensor([1.0] * 4 + [3.0] * 2))
    assert torch.equal(cache.prefix(0, 1, 4)[0][0, :, 0], torch.full((4,), 2.0))


def test_blocks_go_back_on_rollback_and_release_and_a_dry_pool_says_so():
    cache = _cache(num_blocks=4)
    _fill(cache, 0, 13, 1.0)
    assert cache.free_block_count == 0
    with pytest.raises(CacheFullError, match="4 blocks of 4 tokens are all in use"):
        cache.ensure(1, 1)
    cache.rollback(0, 5)  # blocks past slot 5 go back
    assert cache.free_block_count == 2 and len(cache.tables[0]) == 2
    cache.ensure(0, 12)  # a step's draft slots, then only 1 kept
    cache.commit(0, 1)
    assert cache.free_block_count == 2
    cache.rollback(0, 0)
    assert cache.free_block_count == 4 and cache.blocks_needed(1, 9) == 3


def test_a_growable_pool_doubles_when_dry_and_keeps_every_row():
    cache = PagedKVCache(1, 1, 2, 64, torch.float32, "cpu", 2, 2, 4, growable=True)
    _fill(cache, 0, 6, 1.0)
    _fill(cache, 1, 5, 2.0)  # 4 blocks in all: doubled once
    assert cache.num_blocks == 4 and cache.free_block_count == 0
    assert torch.equal(cache.prefix(0, 0, 6)[0][0, :, 0], torch.ones(6))
    assert torch.equal(cache.prefix(0, 1, 5)[1][0, :, 0], torch.full((5,), 2.0))
