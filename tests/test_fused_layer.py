"""An int4 or w8a32 model's compiled layer (specdec/models/fused_layer.py): close to the torch
layer, each row the same alone as in a block, checked at load; refused, with a notice, when wrong."""

import pytest
import torch
from isa_paths import ON_AVX2, outputs_per_path
from tiny import save_random_model

from specdec.models import fused_layer
from specdec.models.base import Attention, Segment
from specdec.models.fused_layer import FusedDecoderLayer, FusedOutput
from specdec.models.loading import load
from specdec.models.transformer import DecoderLayer


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))


def _scaled(function, factor):
    return lambda *args: function(*args) * factor


def _row_dependent(function):
    """Right for one row; a block's rows nudged by 1e-6 (as a kernel blocking by row count would)."""
    return lambda layer, x, *rest: function(layer, x, *rest) * (1 + 1e-6 * (x.shape[0] > 1))


@pytest.mark.parametrize("format", [4, 8])
def test_the_self_check_passes_here_and_refuses_wrong_layer_ops(monkeypatch, format):
    """Mutations: each piece 1e-3 off, or rows of a block differing from alone, fails the check."""
    assert fused_layer.check_layer(0, format) is None
    cases = {
        "mlp_block": (_scaled(fused_layer.mlp_block, 1 + 1e-3), "o + residual + norm + MLP off by"),
        "qkv_projection": (_row_dependent(fused_layer.qkv_projection), "norm + q/k/v + RoPE: a block's rows differ"),
    }
    for name, (wrong, says) in cases.items():
        with monkeypatch.context() as patch:
            patch.setattr(fused_layer, name, wrong)
            assert says in fused_layer.check_layer(0, format)
    original = fused_layer.attend_queries

    def attention_of_the_last_query_only(layer, q, k, v, queries, keys, values, out, *rest):
        original(layer, q, k, v, queries, keys, values, out, *rest)
        out[queries.tokens[:-1]] = 0.0  # forgets all but the last query of a list

    monkeypatch.setattr(fused_layer, "attend_queries", attention_of_the_last_query_only)
    assert "attention" in fused_layer.check_layer(0, format)
    monkeypatch.undo()
    chain = fused_layer.attend_chain

    def chain_one_ulp_off(layer, q, k, v, first, count, committed, slots, keys, values, out, row_base):
        chain(layer, q, k, v, first, count, committed, slots, keys, values, out, row_base)
        out[first + count - 1] = torch.nextafter(out[first + count - 1], torch.tensor(float("inf")))

    monkeypatch.setattr(fused_layer, "attend_chain", chain_one_ulp_off)
    assert "a chain's rows differ" in fused_layer.check_layer(0, format)


@pytest.mark.parametrize("quantize", ["int4", "w8a32"])
@pytest.mark.parametrize("model_type, settings", [("qwen2", {}), ("mistral", {"sliding_window": 6})])
def test_a_packed_model_runs_its_layers_compiled_close_to_the_torch_layers(model_dir, model_type, settings,
                                                                           monkeypatch, quantize):
    """The same int4 (w8a32) weights through the compiled ops and through torch's: logits close
    (other summation orders, and for int4 now and then another int8 rounding of an activation)."""
    folder = save_random_model(model_dir / f"int4-layer-{model_type}", model_type, seed=7, **settings)
    model = load(folder, quantize=quantize)
    network = model.network
    assert all(isinstance(layer, FusedDecoderLayer) for layer in network.layers)
    assert isinstance(network.norm_then_head, FusedOutput)
    assert network.quantize_notice.endswith("; layer ops compiled, keys and values in float16")
    assert model.new_cache().keys.dtype == torch.float16
    assert network.layer_stack is not None  # every layer in one call (tests/test_layer_stack.py); here one by one
    network.layer_stack = None
    calls = []
    for name in ("qkv_projection", "attend_queries", "mlp_block", "norm_then_linear"):
        original = getattr(fused_layer, name)
        monkeypatch.setattr(fused_layer, name, lambda *args, name=name, original=original: (calls.append(name),
                                                                                          original(*args))[1])
    tokens = torch.arange(3, 19)
    compiled = [model.extend(tokens[:10], cache := model.new_cache()), model.extend(tokens[10:], cache)]
    layers = len(network.layers)
    # The prefill attends with SDPA (masked), the block after it query by query in the compiled attention.
    assert calls.count("qkv_projection") == calls.count("mlp_block") == 2 * layers
    assert calls.count("attend_queries") == layers and calls.count("norm_then_linear") == 2
    monkeypatch.setattr(fused_layer, "layer_problem", lambda format: "refused")  # the same weights, torch layers
    torch_model = load(folder, quantize=quantize, kv_dtype="float16")  # the same cache
    assert all(type(layer) is DecoderLayer for layer in torch_model.network.layers)
    in_torch = [torch_model.extend(tokens[:10], cache := torch_model.new_cache()),
                torch_model.extend(tokens[10:], cache)]
    for fast, slow in zip(compiled, in_torch, strict=False):
        assert (fast - slow).abs().max() < (0.02 if quantize == "int4" else 1e-5) * slow.abs().max()


@pytest.mark.parametrize("quantize", ["int4", "w8a32"])
def test_wrong_layer_ops_leave_the_torch_layer_with_a_one_line_notice(model_dir, monkeypatch, quantize):
    monkeypatch.setattr(fused_layer, "layer_problem", lambda format: "attention off by 0.1 (relative)")
    folder = save_random_model(model_dir / "int4-layer-refused", "llama", seed=8)
    model = load(folder, quantize=quantize)
    assert model.precision == quantize and all(type(layer) is DecoderLayer for layer in model.network.layers)
    assert model.network.norm_then_head is None
    notice = model.network.quantize_notice
    assert notice.endswith("; layer ops not compiled (attention off by 0.1 (relative))") and "\n" not in notice


@pytest.mark.parametrize("quantize", ["int4", "w8a32"])
def test_a_forward_mixing_a_prefill_and_a_verify_block_scores_each_row_as_alone(model_dir, quantize):
    """One forward in which row 0 prefills (the compiled chain attention) and row 1 verifies a
    block (the compiled per-query attention) gives each row the bits it gets alone: the server's
    steps mix them. (attend_compiled without its chains passes here, the rows alone lacking them
    too: the prompt and closeness tests above catch that, checked.)"""
    folder = save_random_model(model_dir / "fused-mixed", "qwen2", seed=11)
    model = load(folder, quantize=quantize)
    assert all(isinstance(layer, FusedDecoderLayer) for layer in model.network.layers)
    prompt, context, block = torch.arange(3, 12), torch.arange(20, 27), torch.arange(30, 34)
    cache = model.new_cache(rows=2)
    model.extend(context, cache, row=1)
    positions = torch.cat([torch.arange(9), torch.arange(7, 11)])
    attention = Attention((Segment(0, 9), Segment(1, 4)))
    mixed = model.forward(torch.cat([prompt, block]), positions, cache, attention).logits
    prefill = model.extend(prompt, model.new_cache())
    model.extend(context, verify_cache := model.new_cache())
    verify = model.extend(block, verify_cache)
    assert torch.equal(mixed[:9], prefill) and torch.equal(mixed[9:], verify)


@pytest.mark.parametrize("quantize", ["int4", "w8a32"])
def test_a_prompt_gets_the_same_bits_in_one_forward_as_in_pieces_and_token_by_token(model_dir, quantize):
    """A prompt of 300 tokens (19 of the chain attention's blocks of 16 queries; the MLP call's
    panels of 128 rows and the int4 matmul's of 256 rows) in one forward, in pieces (a chunked
    prefill: the first a chain, the rest per-query blocks) and one token at a time: the same
    logits, bit for bit, so a prompt's last token scores as it would in a verify block. Mutations
    checked: a query not scored on the chunk of keys that starts with its own slot, or the MLP's
    panels skipping a row between them, fail it."""
    folder = save_random_model(model_dir / "fused-prompt", "qwen2", seed=5, max_position_embeddings=512)
    model = load(folder, quantize=quantize)
    assert all(isinstance(layer, FusedDecoderLayer) for layer in model.network.layers)
    prompt = torch.randint(3, model.vocab_size, (300,), generator=torch.Generator().manual_seed(2))
    whole = model.extend(prompt, model.new_cache())
    cache = model.new_cache()
    pieces = torch.cat([model.extend(piece, cache) for piece in prompt.split([17, 1, 140, 142])])
    cache = model.new_cache()
    one_by_one = torch.cat([model.extend(token[None], cache) for token in prompt])
    assert torch.equal(whole, pieces) and torch.equal(whole, one_by_one)


def test_a_chain_past_its_rows_slots_is_refused_before_the_compiled_call_writes(model_dir):
    """The chain call writes where its slots say, unchecked: its plan refuses a row without room
    (a forward that skipped ensure()), as the torch path's cache.write does. Mutation checked:
    without the check, the slots past the cache's capacity are handed on."""
    from specdec.models.attention import plan_attention

    model = load(save_random_model(model_dir / "fused-room", "qwen2", seed=3), quantize="int4")
    cache = model.new_cache()
    count = cache.capacity + 1
    plan = plan_attention(Attention.chain(count), torch.arange(count), cache, {None}, per_query=True)
    with pytest.raises(RuntimeError, match="call ensure"):
        plan.chain_slots(plan.segments[0])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("committed, count", [(0, 1), (0, 33), (45, 20), (3, 300)])
@pytest.mark.parametrize("heads,kv_heads,d", [(6, 2, 64), (14, 2, 40)])
@pytest.mark.parametrize("paged", [False, True])
def test_compiled_chain_attention_gives_each_query_the_bits_of_its_own_slot_list(kv_dtype, committed, count, heads,
                                                                                 kv_heads, d, paged, two_threads):
    """specdec_attend_chain, a chain of `count` queries after `committed` keys (one query; blocks of
    16 queries not filling the last; a context longer than a chunk of 32 keys; more blocks than
    threads; 7 query heads a kv head, a head size the vector slices do not divide), in a row of
    its own cache or scattered over a pool (paged: slots in shuffled order): each query gets the
    bits specdec_attend gives it over its slot list, and what float64 attention gives; the
    chain's keys and values are stored in their slots as torch rounds them; other tokens' outputs
    are left alone. Mutations, checked: a query not scored on the chunk that starts with its own
    slot, a softmax over one slot fewer, or a block's first query left out of softmax and sums,
    fail it."""
    from types import SimpleNamespace

    from specdec.models.attention import query_list

    generator = torch.Generator().manual_seed(committed + count)
    length, first, tokens = committed + count, 2, count + 3
    layer = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=d, attention_scale=d ** -0.5, softcap=None)
    capacity = 2 * length + 5
    slots = torch.randperm(capacity, generator=generator)[:length] if paged else torch.arange(length)
    row = 0 if paged else 1
    keys = torch.randn(2, kv_heads, capacity, d, generator=generator).to(kv_dtype)
    values = torch.randn(2, kv_heads, capacity, d, generator=generator).to(kv_dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=generator)
    q, k, v = qkv.view(tokens, -1, d).transpose(0, 1).split([heads, kv_heads, kv_heads])
    chain_keys, chain_values, chain = keys.clone(), values.clone(), torch.zeros(tokens, heads, d)
    fused_layer.attend_chain(layer, q, k, v, first, count, committed, slots, chain_keys, chain_values, chain,
                             row * keys.stride(0))
    listed = torch.zeros(tokens, heads, d)
    lists = query_list(list(range(first, first + count)), [row] * count,
                       [slots[: committed + i + 1] for i in range(count)])
    fused_layer.attend_queries(layer, q, k, v, lists, keys, values, listed)
    assert torch.equal(chain, listed) and torch.equal(chain_keys, keys) and torch.equal(chain_values, values)
    assert not chain[:first].any() and not chain[first + count:].any()
    for i in range(count):
        token = first + i
        slot = slots[committed + i]
        assert torch.equal(chain_keys[row, :, slot], k[:, token].to(kv_dtype))
        expected = _reference_attention(q[:, token], keys, values, row, slots[: committed + i + 1], heads // kv_heads)
        assert torch.allclose(chain[token].double(), expected, atol=1e-5), i


def _reference_attention(q, keys, values, row, slots, head_groups):  # one query, float64: [heads, d]
    k = keys[row][:, slots].double().repeat_interleave(head_groups, dim=0)  # [heads, count, d]
    v = values[row][:, slots].double().repeat_interleave(head_groups, dim=0)
    weights = torch.softmax((k @ q.double()[:, :, None])[..., 0] / q.shape[-1] ** 0.5, dim=-1)
    return (weights[:, None, :] @ v)[:, 0]


@pytest.fixture
def two_threads():
    """Two threads, as on the 2-core machines the kernel's job split was tuned on."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the kernels' OpenMP runtime is torch's (one libgomp)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("context", [5, 70, 200, 250, 300])
@pytest.mark.parametrize("heads,kv_heads,d", [(6, 2, 64), (14, 2, 40)])
@pytest.mark.parametrize("copies", [1, 3])
def test_compiled_attention_reads_a_rows_shared_keys_once_and_scores_each_query_as_alone(context, kv_dtype, heads,
                                                                                         kv_heads, d, copies,
                                                                                         two_threads):
    """specdec_attend over a batch of rows: a chain of 20 queries after `context` keys and a tree
    of 5 nodes after a shorter context (shared starts longer and shorter than its chunks of keys,
    its scoring spans of 256 slots and its blocks of 16 queries; 7 query heads a kv head, more than
    one gathering pass holds, and a head size the vector slices do not divide), that pair of rows
    once (three passes) or three times (on 2 threads, enough rows that each (row, kv head) is one job).
    Every query gets the bits it gets alone, and what float64 attention over its own slots gives;
    in a 16-bit cache, each query's new key and value are stored as torch rounds them. Mutation,
    checked: a grouped pass that skips the shared start's last chunk, reads the lead query's
    slots for another's own part, scoring spans that stop at the shared start, scoring jobs that
    skip a row's second block of queries, or whole-row jobs that skip a row's last query's
    softmax, fails it."""
    from types import SimpleNamespace

    from specdec.models.attention import query_list

    generator = torch.Generator().manual_seed(context)
    capacity = context + 32
    layer = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=d, attention_scale=d ** -0.5, softcap=None)
    keys = torch.randn(2 * copies, kv_heads, capacity, d, generator=generator).to(kv_dtype)
    values = torch.randn(2 * copies, kv_heads, capacity, d, generator=generator).to(kv_dtype)
    chain, tree_parents, tree_context = 20, [-1, 0, 0, 1, 2], max(context // 2, 1)
    tokens = (chain + len(tree_parents)) * copies
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=generator)
    q, k, v = (qkv.view(tokens, -1, d).transpose(0, 1).split([heads, kv_heads, kv_heads]))
    slot_lists = [torch.arange(context + i + 1) for i in range(chain)]
    for node in range(len(tree_parents)):  # committed slots, then the node's ancestors and itself
        path = [node]
        while tree_parents[path[-1]] >= 0:
            path.append(tree_parents[path[-1]])
        slot_lists.append(torch.cat([torch.arange(tree_context), torch.tensor(path[::-1]) + tree_context]))
    slot_lists = slot_lists * copies
    rows = [2 * copy + row for copy in range(copies) for row in [0] * chain + [1] * len(tree_parents)]
    together = torch.zeros(tokens, heads, d)
    fused_layer.attend_queries(layer, q, k, v, query_list(list(range(tokens)), rows, slot_lists), keys, values,
                               together)
    alone = torch.zeros(tokens, heads, d)
    for index in range(tokens):
        fused_layer.attend_queries(layer, q, k, v, query_list([index], [rows[index]], [slot_lists[index]]), keys,
                                   values, alone)
    assert torch.equal(together, alone)
    for index in range(tokens):  # each query's own key and value in its last slot, as torch stores them
        slot = slot_lists[index][-1]
        assert torch.equal(keys[rows[index], :, slot], k[:, index].to(kv_dtype))
        assert torch.equal(values[rows[index], :, slot], v[:, index].to(kv_dtype))
    for index in range(tokens):
        expected = _reference_attention(q[:, index], keys, values, rows[index], slot_lists[index], heads // kv_heads)
        assert torch.allclose(together[index].double(), expected, atol=1e-5), index


# Under each build: a chain of 4 queries after 30 keys, together, one by one and as a chain call;
# saved for the comparison across builds.
ATTENTION_SCRIPT = (
    "import sys, torch; from types import SimpleNamespace; from specdec.models import fused_layer; "
    "from specdec.models.attention import query_list; w, x = torch.load(sys.argv[2]); "
    "keys = w.reshape(1, 2, 36, 64).clone(); values = w.flip(0).reshape(1, 2, 36, 64).clone(); "
    "qkv = torch.cat([x.flatten()] * 4)[: 4 * 640].view(4, 640); q, k, v = qkv.view(4, 10, 64).transpose(0, 1)"
    ".split([6, 2, 2]); "
    "layer = SimpleNamespace(num_heads=6, num_kv_heads=2, head_dim=64, attention_scale=0.125, softcap=None); "
    "slots = [torch.arange(31 + i) for i in range(4)]; out = torch.zeros(4, 6, 64); "
    "fused_layer.attend_queries(layer, q, k, v, query_list([0, 1, 2, 3], [0] * 4, slots), keys, values, out); "
    "alone = torch.zeros(4, 6, 64); "
    "[fused_layer.attend_queries(layer, q, k, v, query_list([i], [0], [slots[i]]), keys, values, alone) "
    "for i in range(4)]; chain = torch.zeros(4, 6, 64); "
    "fused_layer.attend_chain(layer, q, k, v, 0, 4, 30, torch.arange(34), keys.clone(), values.clone(), chain, 0); "
    "torch.save((out, torch.equal(out, alone) and torch.equal(out, chain)), sys.argv[1])"
)


@pytest.mark.slow  # two more builds of the kernels (g++) and a subprocess each
@pytest.mark.skipif(not ON_AVX2, reason="the AVX2 and plain x86-64 builds need an x86 CPU with AVX2")
def test_compiled_attention_gives_the_same_bits_on_every_instruction_set_path(tmp_path):
    """The attention's vector paths (8 keys' dots at once, the vectorized exp and lane sums) and
    the portable code compute the same formula: the same bits on every build, each query as alone
    and as in a chain call.
    Mutation, checked: a portable exp_minus_and_sum summing its lanes in another order fails it."""
    outputs = outputs_per_path(tmp_path, ATTENTION_SCRIPT)
    for out, rows_alone_equal in outputs.values():
        assert rows_alone_equal
        assert torch.equal(out, outputs[""][0])


def test_the_kv_dtype_is_an_option_of_the_own_forward(model_dir):
    """int4 stores keys and values in float16 unless kv_dtype says otherwise; a float model takes
    bfloat16 when asked (its torch attention computes in float32); an unknown dtype or another
    backend's cache is refused, naming the option."""
    folder = save_random_model(model_dir / "kv-dtype", "llama", seed=9)
    assert load(folder, quantize="int4").new_cache().keys.dtype == torch.float16
    assert load(folder, quantize="int4", kv_dtype="float32").new_cache().keys.dtype == torch.float32
    float_model = load(folder, kv_dtype="bfloat16")
    cache = float_model.new_cache()
    assert cache.keys.dtype == torch.bfloat16 and cache.bytes_per_token == load(folder).new_cache().bytes_per_token // 2
    assert float_model.extend(torch.arange(5), cache).dtype == torch.float32
    assert load(folder, quantize="int4", kv_dtype="bfloat16").new_cache().keys.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown kv_dtype"):
        load(folder, kv_dtype="int8")
    with pytest.raises(ValueError, match="--kv-dtype"):
        load(folder, backend="transformers", kv_dtype="bfloat16")


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_cache_stores_keys_as_torch_rounds_them_at_the_edges(kv_dtype):
    """The compiled attention's own stores round as torch's .to(dtype) does, at the values where a
    conversion goes wrong: halfway cases, the largest finite values and past them (overflow),
    subnormals and the smallest normals, signed zeros, infinities."""
    from types import SimpleNamespace

    from specdec.models.attention import query_list

    d = 64
    info = torch.finfo(kv_dtype)
    edges = torch.tensor([0.0, -0.0, 1.0, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8,
                          float(info.max), float(info.max) * 1.001, -float(info.max) * 1.01, float(info.tiny),
                          float(info.tiny) / 3, 5.96e-8, 2.98e-8, 1e-45, float("inf"), -float("inf"), 65519.9,
                          65520.0, 3.3895e38, -1e-30, 123.456, -0.00012345, 7.0e-6])
    row = torch.cat([edges, torch.randn(d - edges.shape[0], generator=torch.Generator().manual_seed(3)) * 1e3])
    qkv = torch.zeros(1, 3 * d)
    qkv[0, d:2 * d] = row  # the key
    qkv[0, 2 * d:] = row.flip(0)  # the value
    q, k, v = qkv.view(1, 3, d).transpose(0, 1).split([1, 1, 1])
    keys, values = torch.zeros(1, 1, 4, d, dtype=kv_dtype), torch.zeros(1, 1, 4, d, dtype=kv_dtype)
    layer = SimpleNamespace(num_heads=1, num_kv_heads=1, head_dim=d, attention_scale=d ** -0.5, softcap=None)
    fused_layer.attend_queries(layer, q, k, v, query_list([0], [0], [torch.arange(3)]), keys, values,
                               torch.zeros(1, 1, d))
    assert torch.equal(keys[0, 0, 2].view(torch.int16), row.to(kv_dtype).view(torch.int16))
    assert torch.equal(values[0, 0, 2].view(torch.int16), row.flip(0).to(kv_dtype).view(torch.int16))


@pytest.mark.parametrize("top", [0, 7, 8, 15, 16, 20])
def test_compiled_attention_subtracts_the_largest_score_wherever_it_is(top):
    """One key scores 100 and the 20 others 0: exp(100) overflows float32, so the softmax is right
    only if the largest score it subtracts is that key's, whether it sits in the 8-lane body of the
    maximum's loop or its tail (slot 20: the query's own key). Mutation, checked: a maximum that
    skips the tail, or the body's second 8 scores, fails it."""
    from types import SimpleNamespace

    from specdec.models.attention import query_list

    d, count = 64, 21
    generator = torch.Generator().manual_seed(top)
    keys, values = torch.zeros(1, 1, count + 3, d), torch.randn(1, 1, count + 3, d, generator=generator)
    qkv = torch.zeros(1, 3 * d)
    qkv[0, 0] = 40.0  # q . k * d ** -0.5 = 40 * 20 / 8 = 100 for the chosen key
    qkv[0, 2 * d:] = torch.randn(d, generator=generator)  # the query's own value
    if top == count - 1:
        qkv[0, d] = 20.0
    else:
        keys[0, 0, top, 0] = 20.0
    q, k, v = qkv.view(1, 3, d).transpose(0, 1).split([1, 1, 1])
    out = torch.zeros(1, 1, d)
    layer = SimpleNamespace(num_heads=1, num_kv_heads=1, head_dim=d, attention_scale=d ** -0.5, softcap=None)
    fused_layer.attend_queries(layer, q, k, v,
                               query_list([0], [0], [torch.arange(count)]), keys, values, out)
    assert torch.allclose(out[0, 0], values[0, 0, top], atol=1e-6)


# Under each build: every checked layer variant's compiled q/k/v (q/k norms, partial rotary) and MLP
# (output norms, GELU-tanh) and its soft-capped attention, on layers packed once in the test.
VARIANTS_SCRIPT = (
    "import sys, torch; from specdec.models import fused_layer; from specdec.models.attention import query_list; "
    "layers = torch.load(sys.argv[2].replace('inputs.pt', 'layers.pt'), weights_only=False); "
    "w, x = torch.load(sys.argv[2]); rows = x[:, :64].contiguous(); "
    "angles = torch.arange(3, 12)[:, None] * w[0, :8].abs()[None]; results = {}; "
    "[results.update({name: (fused_layer.qkv_projection(layer, rows, "
    "(a := angles[:, :layer.rotary // 2].repeat(1, 2)).cos(), a.sin()), "
    "fused_layer.mlp_block(layer, rows, x[:, :64].flip(1).contiguous()))}) for name, layer in layers.items()]; "
    "layer = layers['gemma2']; qkv = results['gemma2'][0]; q, k, v = qkv.transpose(0, 1).split([4, 2, 2]); "
    "keys = w[:24, :64].reshape(1, 2, 48, 16).clone(); values = keys.flip(2).clone(); out = torch.zeros(9, 4, 16); "
    "fused_layer.attend_queries(layer, q, k, v, query_list(list(range(9)), [0] * 9, [torch.arange(10 + i) for i in "
    "range(9)]), keys, values, out); results['attention'] = out; torch.save(results, sys.argv[1])"
)


@pytest.mark.slow  # two more builds of the kernels (g++) and a subprocess each
@pytest.mark.skipif(not ON_AVX2, reason="the AVX2 and plain x86-64 builds need an x86 CPU with AVX2")
def test_each_layer_variant_gives_the_same_bits_on_every_instruction_set_path(tmp_path):
    """The variants' new code (GELU-tanh's vector path beside its scalar one, q/k norms, norms on
    the outputs, partial rotary, soft-capping) computes one formula: the same bits on every build.
    w8a32 linears, whose float32 activations carry every bit into the output (int4's int8
    activations would round a last-bit difference away). Mutation, checked: the scalar GELU-tanh
    taking std::tanh instead of the shared exp formula fails it."""
    from specdec.models.w8a32 import W8A32Linear

    generator = torch.Generator().manual_seed(0)
    layers = {name: fused_layer.random_layers(generator, W8A32Linear, **variant)[1]
              for name, variant in fused_layer.CHECKED_VARIANTS.items()}
    torch.save(layers, tmp_path / "layers.pt")
    outputs = outputs_per_path(tmp_path, VARIANTS_SCRIPT)
    native = outputs[""]
    assert set(native) == {*fused_layer.CHECKED_VARIANTS, "attention"}
    for results in outputs.values():
        for name, value in results.items():
            expected = native[name]
            assert all(torch.equal(a, b) for a, b in zip(value, expected, strict=True)) if isinstance(value, tuple) \
                else torch.equal(value, expected), name
