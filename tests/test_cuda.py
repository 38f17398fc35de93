"""The CPU suite's guarantees on a CUDA GPU, where CI cannot check them (it has no GPU): verify
blocks scored exactly as each token alone, greedy speculation token-identical to target-only,
seeded samples independent of a request's neighbours, and `specdec train-head` / `generate
--draft-head` with --device cuda. Skipped without a GPU; on one:

    python -m pytest tests/test_cuda.py -n 0 -v      # 7 passed in 335 s on an H200, 2026-11-26

After lockstep drafting (the draft model's chain and tree, 40 prompts in one batch too): 6 passed
in 357 s on an H100, 2026-11-26 17:20 (`-k "not train_head"`: the default target's GGUF, 94 MB,
does not fit what travels to the lent machine).
"""

import json
from pathlib import Path

import pytest
import torch
from test_exact_blocks import TREE_DEPTHS, TREE_PARENTS, alone_logits
from test_greedy_equality import random_cases
from tiny import save_random_model

import specdec
from specdec import SamplingParams, SpeculativeDecoder, load, make_drafter
from specdec.drafting.head_format import new_head
from specdec.models.base import Attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = "cuda"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_blocks_equal_each_token_alone(wide_model_dir, dtype):
    """cuBLAS picks its kernel (and split of the sum) by shape: the fixed 8-row linears and
    per-query attention must make a block's rows bit-identical to one-token forwards here too."""
    model = load(wide_model_dir, dtype=dtype, device=CUDA)
    assert model.device.type == torch.device(CUDA).type
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 512, (40,), generator=generator).to(CUDA)
    tokens = torch.randint(0, 512, (11,), generator=generator).to(CUDA)
    for count in (2, 5, 8, 9, 11):
        cache = model.new_cache()
        model.extend(prefix, cache)
        positions = torch.arange(40, 40 + count, device=CUDA)
        block = model.forward(tokens[:count], positions, cache, Attention.chain(count)).logits
        expected = alone_logits(model, prefix, tokens[:count], list(range(-1, count - 1)))
        assert torch.equal(block, expected), f"{dtype}, block of {count}"
    cache = model.new_cache()
    model.extend(prefix, cache)
    positions = torch.tensor([40 + depth for depth in TREE_DEPTHS], device=CUDA)
    nodes = tokens[:len(TREE_PARENTS)]
    tree = model.forward(nodes, positions, cache, Attention.tree(TREE_PARENTS)).logits
    assert torch.equal(tree, alone_logits(model, prefix, nodes, TREE_PARENTS)), f"{dtype}, tree"


@pytest.fixture(scope="module")
def cuda_pair(tiny_pair):
    load_one = lambda path: load(path, dtype="float64", device=CUDA)  # noqa: E731
    return load_one(tiny_pair["target"]), load_one(tiny_pair["perturbed"])


def test_cuda_greedy_speculation_equals_target_only(cuda_pair):
    """Draft model (chain and tree), n-gram, head chain and head tree, 40 random prompts each, and
    all 40 in one batch (the draft model and the head drafting in lockstep for all)."""
    target, perturbed = cuda_pair
    torch.manual_seed(1)
    head = new_head(target).to(device=CUDA, dtype=target.dtype)
    drafters = {"same": make_drafter("model", target), "perturbed": make_drafter("model", perturbed),
                "tree": make_drafter("tree", perturbed, tree_budget=6),
                "ngram": make_drafter("ngram", max_n=3), "head": make_drafter("head", target=target, head=head),
                "head-tree": make_drafter("head-tree", target=target, head=head, tree_budget=6)}
    baseline = SpeculativeDecoder(target)
    accepted = {name: [0, 0] for name in drafters}
    for prompt, max_new_tokens, gamma in random_cases(11, target.vocab_size, count=40):
        expected = baseline.generate(prompt, max_new_tokens=max_new_tokens)
        for name, drafter in drafters.items():
            result = SpeculativeDecoder(target, drafter, gamma=gamma).generate(prompt, max_new_tokens=max_new_tokens)
            assert result.token_ids == expected.token_ids, (name, prompt, max_new_tokens, gamma)
            accepted[name][0] += result.stats.accepted
            accepted[name][1] += result.stats.drafted
    assert accepted["same"][0] == accepted["same"][1] > 0
    assert 0 < accepted["perturbed"][0] < accepted["perturbed"][1]
    cases = random_cases(11, target.vocab_size, count=40)
    prompts = [prompt for prompt, _, _ in cases]
    expected = [baseline.generate(prompt, max_new_tokens=16).token_ids for prompt in prompts]
    for name in ("perturbed", "tree", "head"):
        together = SpeculativeDecoder(target, drafters[name], gamma=3).generate(prompts, max_new_tokens=16)
        assert [result.token_ids for result in together] == expected, name


def test_cuda_seeded_samples_do_not_depend_on_the_batch(cuda_pair):
    """Each request samples from its own CUDA generator: alone or beside others, the same tokens."""
    target, perturbed = cuda_pair
    decoder = SpeculativeDecoder(target, make_drafter("model", perturbed), gamma=3)
    prompts = [[(start * 5 + i) % 96 for i in range(4 + start)] for start in range(4)]
    settings = [SamplingParams(temperature=1.0, seed=seed, max_new_tokens=20) for seed in range(4)]
    together = decoder.generate(prompts, sampling=settings)
    for prompt, sampling, result in zip(prompts, settings, together, strict=True):
        assert decoder.generate(prompt, sampling=sampling).token_ids == result.token_ids
    assert len({tuple(result.token_ids) for result in together}) > 1


def test_cuda_train_head_and_draft_with_it(tmp_path, capsys):
    """`specdec train-head --device cuda` trains on the GPU, and the head drafts there: the text
    is the target's alone."""
    from specdec.commands.cli import main
    from specdec.defaults import default_model

    target = str(default_model("target"))
    assert main(["train-head", "--target", target, "--device", CUDA, "--out", str(tmp_path),
                 "--data", str(Path(specdec.__file__).parent), "--steps", "20", "--sequence-length", "48",
                 "--corpus-sequences", "24", "--continuation-sequences", "4", "--heldout-sequences", "2",
                 "--draft-vocab", "256", "--batch-size", "4", "--eval-every", "10"]) == 0
    assert "depth 1:" in (tmp_path / "head" / "README.md").read_text()
    capsys.readouterr()
    texts = []
    for options in (["--drafter", "head-tree", "--draft-head", str(tmp_path / "head")], ["--no-draft"]):
        assert main(["generate", "def add(a, b):", "--target", target, "--device", CUDA, "--max-new-tokens", "24",
                     "--json", *options]) == 0
        texts.append(json.loads(capsys.readouterr().out)["text"])
    assert texts[0] == texts[1]


@pytest.mark.parametrize("kind", ["head", "head-tree"])
def test_cuda_samples_follow_the_targets_law(tmp_path_factory, kind):
    """Rejection sampling with CUDA generators, chains and trees: chi-square of 20k seeded 3-token
    generations against the target's enumerated law (test_heads' law test, on the GPU)."""
    from law import assert_matches_law, sample_sequences
    from test_heads import exact_law

    folder = save_random_model(tmp_path_factory.mktemp("six"), vocab_size=6, seed=5, init_scale=0.5,
                               tokenizer=False, bos_token_id=None, eos_token_id=None)  # no EOS: 3 tokens always
    target = load(folder, dtype="float64", device=CUDA)
    torch.manual_seed(4)
    head = new_head(target, torch.tensor([0, 2, 3, 5])).to(device=CUDA, dtype=target.dtype)
    with torch.no_grad():
        head.lm_head.weight.mul_(20.0)  # peaked q, so that drafts are accepted and rejected
    sampling = SamplingParams(temperature=0.9, top_k=4)
    decoder = SpeculativeDecoder(target, make_drafter(kind, target=target, head=head, tree_budget=6), gamma=2)
    counts, accepted, drafted = sample_sequences(decoder, [1, 4, 2], sampling, 3, 20000)
    assert 0 < accepted < drafted
    assert_matches_law(counts, exact_law(load(folder, dtype="float64"), [1, 4, 2], 3, sampling), kind)
