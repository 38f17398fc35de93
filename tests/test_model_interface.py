"""The v2 model interface: explicit positions, chain and tree attention over ragged batches,
and the cache verbs (commit, rollback, compact), each checked against plain chain forwards."""

import pytest
import torch
from tiny import save_random_model

from specdec import Attention, load
from specdec.models.base import Segment, tree_depths

# Node i's parent (-1 = the committed context): two branches off the root, a second root.
PARENTS = [-1, 0, 0, 1, 1, 2, -1, 6, 3]
PREFIX = 10


@pytest.fixture(scope="module")
def tree_models(model_dir):
    return {
        "llama": save_random_model(model_dir / "tree-llama", "llama", seed=20, init_scale=0.3),
        "qwen2-bias": save_random_model(model_dir / "tree-qwen2", "qwen2", seed=21, init_scale=0.3),
        "mistral-window": save_random_model(model_dir / "tree-mistral", "mistral", seed=22, init_scale=0.3,
                                            sliding_window=6),
    }


def path_to(node: int) -> list[int]:
    path = [node]
    while PARENTS[path[-1]] >= 0:
        path.append(PARENTS[path[-1]])
    return path[::-1]


def tree_forward(model, prefix, nodes):
    """Logits of every tree node, one forward, after a committed prefix."""
    cache = model.new_cache()
    model.extend(prefix, cache)
    positions = torch.tensor([PREFIX + depth for depth in tree_depths(PARENTS)])
    return model.forward(nodes, positions, cache, Attention.tree(PARENTS)).logits, cache


def chain_logits(model, tokens):  # [k] -> [k, vocab], a fresh chain forward
    return model.extend(tokens, model.new_cache())


@pytest.mark.parametrize("kind", ["llama", "qwen2-bias", "mistral-window"])
def test_tree_nodes_get_the_logits_of_their_root_to_node_chain(tree_models, kind):
    model = load(tree_models[kind], dtype="float64")
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, model.vocab_size, (PREFIX,), generator=generator)
    nodes = torch.randint(0, model.vocab_size, (len(PARENTS),), generator=generator)
    logits, _ = tree_forward(model, prefix, nodes)
    for node in range(len(PARENTS)):
        expected = chain_logits(model, torch.cat([prefix, nodes[path_to(node)]]))[-1]
        torch.testing.assert_close(logits[node], expected, atol=1e-10, rtol=0, msg=f"node {node}")


@pytest.mark.parametrize("quantize", ["int8", "int4", "w8a32"])
def test_int8_tree_nodes_are_bit_identical_to_their_chains(tree_models, quantize):
    """int8 (and int4) attend one query at a time over exactly its keys: a tree changes no bit."""
    model = load(tree_models["llama"], quantize=quantize)
    assert model.precision == quantize
    generator = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, model.vocab_size, (PREFIX,), generator=generator)
    nodes = torch.randint(0, model.vocab_size, (len(PARENTS),), generator=generator)
    logits, _ = tree_forward(model, prefix, nodes)
    for node in range(len(PARENTS)):
        cache = model.new_cache()
        model.extend(prefix, cache)  # the prefill, then the path one token at a time
        alone = [model.extend(token[None], cache) for token in nodes[path_to(node)]][-1][0]
        assert torch.equal(logits[node], alone), f"node {node}"


@pytest.mark.parametrize("kind", ["llama", "mistral-window"])
def test_compact_leaves_the_cache_of_a_fresh_chain_prefill(tree_models, kind):
    model = load(tree_models[kind], dtype="float64")
    generator = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, model.vocab_size, (PREFIX,), generator=generator)
    nodes = torch.randint(0, model.vocab_size, (len(PARENTS),), generator=generator)
    _, cache = tree_forward(model, prefix, nodes)
    accepted = path_to(8)  # 0 -> 1 -> 3 -> 8: nodes spread over the block
    cache.compact(0, accepted)
    fresh = model.new_cache()
    model.extend(torch.cat([prefix, nodes[accepted]]), fresh)
    length = PREFIX + len(accepted)
    assert cache.lengths[0] == fresh.lengths[0] == length
    torch.testing.assert_close(cache.keys[..., :length, :], fresh.keys[..., :length, :], atol=1e-12, rtol=0)
    torch.testing.assert_close(cache.values[..., :length, :], fresh.values[..., :length, :], atol=1e-12, rtol=0)
    # and decoding goes on from it as from the fresh cache
    token = torch.tensor([3])
    torch.testing.assert_close(model.extend(token, cache), model.extend(token, fresh), atol=1e-10, rtol=0)


@pytest.mark.parametrize("kind, backend", [("target", "specdec"), ("target", "transformers"),
                                           ("mistral-window", "specdec")])
def test_a_ragged_batch_scores_each_row_as_alone(tiny_pair, tree_models, kind, backend):
    """Rows of different lengths and block sizes in one forward, in rows out of order; each
    row's logits equal its own single-row forward; commit and rollback act per row."""
    folder = tiny_pair["target"] if kind == "target" else tree_models[kind]
    model = load(folder, dtype="float64", backend=backend)
    generator = torch.Generator().manual_seed(3)
    prefixes = [torch.randint(0, model.vocab_size, (n,), generator=generator) for n in (5, 1, 12)]
    blocks = [torch.randint(0, model.vocab_size, (k,), generator=generator) for k in (3, 1, 5)]
    rows = (2, 0, 1)  # segment s lives in cache row rows[s]
    cache = model.new_cache(rows=3)
    for row, prefix in zip(rows, prefixes, strict=True):
        model.extend(prefix, cache, row)
    tokens = torch.cat(blocks)
    positions = torch.cat([torch.arange(p.shape[0], p.shape[0] + b.shape[0])
                           for p, b in zip(prefixes, blocks, strict=True)])
    attention = Attention(tuple(Segment(row, b.shape[0]) for row, b in zip(rows, blocks, strict=True)))
    logits = model.forward(tokens, positions, cache, attention).logits
    for segment, (prefix, block) in enumerate(zip(prefixes, blocks, strict=True)):
        start = attention.offsets[segment]
        expected = chain_logits(model, torch.cat([prefix, block]))[prefix.shape[0]:]
        torch.testing.assert_close(logits[start : start + block.shape[0]], expected, atol=1e-10, rtol=0)
    # keep two tokens of segment 0, none of segment 1, all of segment 2, then roll segment 2 back
    for row, kept in zip(rows, (2, 0, 5), strict=True):
        cache.commit(row, kept)
    assert cache.lengths == [1, 17, 7]
    cache.rollback(1, 14)
    histories = [torch.cat([prefixes[0], blocks[0][:2]]), prefixes[1], torch.cat([prefixes[2], blocks[2][:2]])]
    # one more token for segments 2 and 0 only: a subset of rows, not in order
    nxt = torch.tensor([7, 9])
    step = Attention((Segment(rows[2], 1), Segment(rows[0], 1)))
    out = model.forward(nxt, torch.tensor([14, 7]), cache, step).logits
    for index, segment in enumerate((2, 0)):
        expected = chain_logits(model, torch.cat([histories[segment], nxt[index : index + 1]]))[-1]
        torch.testing.assert_close(out[index], expected, atol=1e-10, rtol=0)


def test_hidden_states_on_request(tiny_pair):
    """hidden_layers asks for the outputs of those decoder layers, concatenated in the order asked:
    the same tensors on the own forward and the transformers adapter (hidden_states[i + 1]; its last
    entry is after the final norm, so the adapter refuses the last layer)."""
    model = load(tiny_pair["target"], dtype="float64")
    reference = load(tiny_pair["target"], dtype="float64", backend="transformers")
    tokens, positions = torch.tensor([1, 2, 3]), torch.arange(3)
    output = model.forward(tokens, positions, model.new_cache(), Attention.chain(3), hidden_layers=(1, 0))
    assert output.hidden.shape == (3, 64) and output.logits.shape == (3, model.vocab_size)
    assert not torch.equal(output.hidden[:, :32], output.hidden[:, 32:])  # two different layers (mutation: same index)
    expected = reference.forward(tokens, positions, reference.new_cache(), Attention.chain(3), hidden_layers=(0,))
    torch.testing.assert_close(output.hidden[:, 32:], expected.hidden, atol=1e-10, rtol=0)
    with pytest.raises(ValueError, match="last layer"):
        reference.forward(tokens, positions, reference.new_cache(), Attention.chain(3), hidden_layers=(1,))
    cache = model.new_cache()
    assert model.forward(tokens[:1], positions[:1], cache, Attention.chain(1), want_logits=False).logits is None
    with pytest.raises(ValueError, match="layers 0..1"):
        model.forward(tokens[:1], positions[:1], cache, Attention.chain(1), hidden_layers=(2,))


def test_the_adapter_refuses_trees_clearly(tiny_pair):
    model = load(tiny_pair["target"], backend="transformers")
    cache = model.new_cache()
    with pytest.raises(ValueError, match="chains only; use --backend specdec for token trees"):
        model.forward(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 1]), cache, Attention.tree([-1, 0, 0]))
    model.extend(torch.tensor([1, 2]), cache)
    with pytest.raises(ValueError, match="keeps chain prefixes only"):
        cache.compact(0, [1])


def test_bad_attention_and_verbs_are_named(tiny_pair):
    model = load(tiny_pair["target"])
    cache = model.new_cache(rows=2)
    with pytest.raises(ValueError, match=r"parents\[i\] < i; nodes \[1\]"):
        Attention.tree([-1, 1])
    with pytest.raises(ValueError, match="cache row 2 does not exist"):
        model.forward(torch.tensor([1]), torch.tensor([0]), cache, Attention.chain(1, row=2))
    with pytest.raises(ValueError, match="attention covers 2 tokens, the block has 1"):
        model.forward(torch.tensor([1]), torch.tensor([0]), cache, Attention.chain(2))
    with pytest.raises(ValueError, match="past the context length 128"):
        model.forward(torch.zeros(129, dtype=torch.long), torch.arange(129), cache, Attention.chain(129))
    with pytest.raises(ValueError, match="cannot roll row 0 of length 0 back to 3"):
        cache.rollback(0, 3)
    with pytest.raises(ValueError, match="increasing offsets"):
        cache.compact(0, [2, 1])


def test_unused_cache_slots_are_finite(tiny_pair):
    """A padded batch attends, masked, over slots other rows have not written: they must hold
    finite numbers (a NaN survives a mask), so the cache starts zeroed and grows zeroed."""
    model = load(tiny_pair["target"])
    cache = model.new_cache(rows=3)
    model.extend(torch.tensor([1, 2, 3]), cache, row=1)
    cache.reserve(cache.capacity + 1)  # growth keeps the written slots and zeroes the new ones
    assert torch.isfinite(cache.keys).all() and torch.isfinite(cache.values).all()
    assert cache.keys[:, 0].abs().sum() == 0 and cache.keys[:, 1, :, :3].abs().sum() > 0


@pytest.mark.parametrize("kind", ["llama", "mistral-window"])
def test_a_tree_grown_over_several_forwards_equals_one_forward(tree_models, kind):
    """Nodes fed later attend to the nodes earlier forwards wrote (uncommitted): the logits are
    those of the whole tree fed at once."""
    model = load(tree_models[kind], dtype="float64")
    generator = torch.Generator().manual_seed(7)
    prefix = torch.randint(0, model.vocab_size, (PREFIX,), generator=generator)
    nodes = torch.randint(0, model.vocab_size, (len(PARENTS),), generator=generator)
    whole, _ = tree_forward(model, prefix, nodes)
    cache = model.new_cache()
    model.extend(prefix, cache)
    depths = tree_depths(PARENTS)
    pieces = []
    for start, end in ((0, 3), (3, 6), (6, 9)):
        positions = torch.tensor([PREFIX + d for d in depths[start:end]])
        segment = Segment(0, end - start, tuple(PARENTS[:end]), written=start)
        pieces.append(model.forward(nodes[start:end], positions, cache, Attention((segment,))).logits)
    torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-10, rtol=0)
    assert cache.lengths[0] == PREFIX  # nothing committed


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_a_restricted_output_scores_only_its_tokens(tmp_path, quantize):
    """restrict_output (a draft's cheaper head): the chosen tokens keep their logits (bit for bit
    in int8, whose integer products are exact in any shape; to float32 rounding in float32, where
    a 5-row head and a full one take different BLAS blockings: seen on AVX2), every other token
    gets -inf; bad ids are refused. Only drafts restrict their output: q changes speed, not output."""
    from tiny import save_random_model

    from specdec.models.base import Attention
    from specdec.models.loading import load

    folder = save_random_model(tmp_path / "m", tie_word_embeddings=True)
    full, restricted = load(folder), load(folder)
    keep = torch.tensor([3, 7, 8, 20, 41])
    restricted.network.restrict_output(keep)
    if quantize:
        from specdec.models.precisions import quantize_model

        quantize_model(full.network, "int8")
        quantize_model(restricted.network, "int8")
    tokens = torch.tensor([5, 9, 11, 2])
    logits = {}
    for name, model in (("full", full), ("restricted", restricted)):
        logits[name] = model.forward(tokens, torch.arange(4), model.new_cache(), Attention.chain(4)).logits
    if quantize:
        assert torch.equal(logits["restricted"][:, keep], logits["full"][:, keep])
    else:
        torch.testing.assert_close(logits["restricted"][:, keep], logits["full"][:, keep], rtol=1e-6, atol=1e-6)
    others = torch.ones(logits["full"].shape[1], dtype=torch.bool)
    others[keep] = False
    assert torch.isneginf(logits["restricted"][:, others]).all()
    with pytest.raises(ValueError, match="distinct"):
        load(folder).network.restrict_output(torch.tensor([1, 1]))
