"""Exact verify blocks in float dtypes (load(exact=True), the default): every token of a block,
chain or tree, gets bit-for-bit the logits it gets scored alone after the same context.

Mutation checked by hand (2-core Xeon, no AMX): with the linears in plain calls (fixed_rows None,
per-query attention kept) both fp32 tests fail (a 256-wide model's blocks differ from one-token
forwards in the last bits); the bf16 cases still pass then, since bf16 rounding hides those bits
at this size (on the real Qwen2.5-Coder-1.5B in bf16 the same mutation leaves logits 0.13 apart).
Second mutation (same machine): attention groups padded to their longest query instead of each
query's own multiple of QUERY_BUCKET keys fails 6 of the 7 tests (a query alone and inside a block
then runs on different key lengths).
Third (2-core AMD EPYC, AVX2, torch 2.13): a QueryGroup's queries in one batched SDPA call instead
of one call each fails the two-thread cases (the CPU flash kernel splits its work by batch size
and thread count; the suite runs one thread per worker, which hid it; real runs use two).
"""

import pytest
import torch

from specdec.models.base import Attention
from specdec.models.loading import load

WIDE = dict(hidden_size=256, intermediate_size=768, num_attention_heads=8, num_key_value_heads=2, vocab_size=512,
            max_position_embeddings=256)
TREE_PARENTS = [-1, -1, 0, 0, 1, 2, 2, 4, 5, 3]
TREE_DEPTHS = (0, 0, 1, 1, 1, 2, 2, 2, 3, 2)  # of each node of TREE_PARENTS


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """Real runs use every core: kernels that split work by thread count must stay exact there too."""
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(1)


def alone_logits(model, prefix, tokens, path_parents=None):
    """Each token scored by itself after the prefilled prefix and its chain (or tree) ancestors, fed
    one token per forward: what target-only decoding computes."""
    rows = []
    for index in range(len(tokens)):
        chain = [index]
        while path_parents is not None and path_parents[chain[0]] >= 0:
            chain.insert(0, path_parents[chain[0]])
        cache = model.new_cache()
        model.extend(prefix, cache)
        for position, node in enumerate(chain):
            position_ids = torch.tensor([len(prefix) + position], device=model.device)
            out = model.forward(tokens[node : node + 1], position_ids, cache, Attention.chain(1))
            cache.commit(0, 1)
        rows.append(out.logits[0])
    return torch.stack(rows)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("context", [40, 27])  # 27: the block's queries see 28..38 keys, two QUERY_BUCKETs
def test_every_block_row_equals_that_token_alone(wide_model_dir, dtype, context, threads):
    model = load(wide_model_dir, dtype=dtype)
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 512, (context,), generator=generator)
    tokens = torch.randint(0, 512, (11,), generator=generator)
    for count in (2, 5, 8, 9, 11):  # 9 and 11 span two calls of the fixed row count
        cache = model.new_cache()
        model.extend(prefix, cache)
        positions = torch.arange(context, context + count)
        block = model.forward(tokens[:count], positions, cache, Attention.chain(count)).logits
        expected = alone_logits(model, prefix, tokens[:count], list(range(-1, count - 1)))
        assert torch.equal(block, expected), f"{dtype}, block of {count}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tree_block_equals_each_node_alone(wide_model_dir, dtype, threads):
    model = load(wide_model_dir, dtype=dtype)
    parents = TREE_PARENTS
    tokens = torch.arange(100, 100 + len(parents))
    prefix = torch.arange(30)
    cache = model.new_cache()
    model.extend(prefix, cache)
    positions = torch.tensor([30 + depth for depth in TREE_DEPTHS])
    block = model.forward(tokens, positions, cache, Attention.tree(parents)).logits
    assert torch.equal(block, alone_logits(model, prefix, tokens, parents))


def test_exactness_is_a_load_option(wide_model_dir):
    assert load(wide_model_dir).network.fixed_rows == 8
    assert load(wide_model_dir, exact=False).network.fixed_rows is None
    assert load(wide_model_dir, quantize="int8").network.fixed_rows is None  # integer products are exact anyway
    with pytest.raises(ValueError, match="fixed_rows"):
        load(wide_model_dir, exact=False).network.make_batch_invariant(0)
