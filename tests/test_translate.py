"""A draft with another tokenizer (specdec.drafting.translate): tokenizers compared rather than
vocabulary sizes, greedy output equal to the target's own, and the target's law kept when
sampling (p = target, q = draft)."""

import dataclasses
import itertools
import json
import os
from pathlib import Path

import pytest
import torch
from law import assert_matches_law, sample_sequences
from table_lm import TokenCache, table_model
from tiny import save_char_tokenizer, save_random_model

from specdec import SamplingParams, SpeculativeDecoder, load, logits_to_probs, make_drafter
from specdec.drafting import ModelDrafter, TranslatingDrafter
from specdec.models.base import ForwardOutput, LanguageModel, check_forward

ALPHABET = list("abcdefghijklmnopqrstuvwxyz0123456789 ():,.=+-_\n")
CODE = ["def add(a, b):\n    return a + b\n", "for item in items:\n    total = total + item\n",
        "class point:\n    def norm(self):\n        return (self.x ** 2 + self.y ** 2) ** 0.5\n",
        "while count < 10:\n    count = count + 1\n", "if value is none:\n    value = default(key)\n"]
PROMPTS = ["def add(a, b):", "for item in", "class point:\n    def"]


def train_bpe(corpus: list[str], vocab_size: int, special: list[str], byte_level: bool = False):
    """A BPE tokenizer trained here with the tokenizers library (a transformers fast tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None if byte_level else special[-1]))
    alphabet = ALPHABET
    if byte_level:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tokenizer.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, initial_alphabet=alphabet,
                                  show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


@pytest.fixture(scope="module")
def bpe_pairs(model_dir):
    """For plain and byte-level BPE: a tiny random target and draft, each with its own tokenizer
    (other corpus, other size, other special tokens: ids that name different strings)."""
    pairs = {}
    for byte_level in (False, True):
        extra = 256 if byte_level else 0
        tokenizers = {"target": train_bpe(CODE, extra + 120, ["<unk>"], byte_level),
                      "draft": train_bpe(CODE[::-1][:3], extra + 80, ["<pad>", "<unk>"], byte_level)}
        models = {}
        for role, seed in (("target", 0), ("draft", 1)):
            folder = model_dir / f"bpe-{role}-{'bytes' if byte_level else 'chars'}"
            save_random_model(folder, "llama", seed=seed, init_scale=0.3, tokenizer=False,
                              vocab_size=len(tokenizers[role]))
            tokenizers[role].save_pretrained(str(folder))
            models[role] = load(folder)
        pairs[byte_level] = models
    return pairs


@pytest.mark.parametrize("byte_level", [False, True], ids=["bpe", "byte-level-bpe"])
def test_different_tokenizers_greedy_equals_target_only(bpe_pairs, byte_level):
    target, draft = bpe_pairs[byte_level]["target"], bpe_pairs[byte_level]["draft"]
    drafter = make_drafter("model", draft, target=target)
    assert isinstance(drafter, TranslatingDrafter)
    expected = SpeculativeDecoder(target).generate(PROMPTS, max_new_tokens=40)
    got = SpeculativeDecoder(target, drafter, gamma=4).generate(PROMPTS, max_new_tokens=40)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert sum(r.stats.source_drafted for r in got) > 0  # it did draft, and translate
    assert all(r.stats.source_kept <= r.stats.source_drafted for r in got)


@pytest.mark.parametrize("vocab_rule", ["point-mass", "intersection"])
def test_a_seed_gives_the_target_alones_text_through_translation(bpe_pairs, vocab_rule):
    """The coupled rule (a seed's default) with a draft of another tokenizer: the seeded samples
    are the target alone's, token for token, for both vocabulary rules, alone and batched."""
    target, draft = bpe_pairs[True]["target"], bpe_pairs[True]["draft"]
    drafter = TranslatingDrafter(draft, target, vocab_rule=vocab_rule)
    samplings = [SamplingParams(temperature=0.9, seed=seed, max_new_tokens=30) for seed in range(len(PROMPTS))]
    expected = SpeculativeDecoder(target).generate(PROMPTS, samplings)
    decoder = SpeculativeDecoder(target, drafter, gamma=4)
    together = decoder.generate(PROMPTS, samplings)
    assert [r.token_ids for r in together] == [r.token_ids for r in expected]
    assert sum(r.stats.drafted for r in together) > 0  # it did draft
    assert decoder.generate(PROMPTS[0], samplings[0]).token_ids == expected[0].token_ids

def test_cli_says_how_many_drafted_tokens_survived_translation(bpe_pairs, capsys):
    from specdec.commands.cli import main

    target, draft = bpe_pairs[False]["target"], bpe_pairs[False]["draft"]
    base = ["generate", "--target", target.path, "--draft", draft.path, "def add(a, b):", "--max-new-tokens", "16"]
    assert main(base + ["--show"]) == 0
    assert "translated draft tokens" in capsys.readouterr().err  # the stats table's row
    assert main(base + ["--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert 0 < stats["source_kept"] <= stats["source_drafted"]
    assert main(base + ["--json", "--temperature", "0.8", "--vocab-rule", "intersection"]) == 0
    stats = json.loads(capsys.readouterr().out)  # each drafted token is one shared token: all kept
    assert 0 < stats["source_kept"] == stats["source_drafted"]

class TextOracleNetwork:
    """A draft "model" that knows the text to come: after a context whose text is a prefix of
    ``text``, its logit is on the longest token of its vocabulary that the rest starts with.
    Its guesses are right in text; whether they are accepted depends on the translation."""

    def __init__(self, tokenizer, text: str) -> None:
        self.tokenizer, self.text = tokenizer, text
        pieces = ((tokenizer.decode([i]), i) for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids)
        self.pieces = sorted(pieces, key=lambda piece: -len(piece[0]))

    def new_cache(self, max_length: int, rows: int = 1) -> TokenCache:
        return TokenCache(max_length, rows)

    def __call__(self, tokens, positions, cache, attention, want_logits=True, want_hidden=False) -> ForwardOutput:
        check_forward(tokens, positions, cache, attention)
        logits = []
        for segment, start, end in zip(attention.segments, attention.offsets, attention.offsets[1:], strict=False):
            committed = cache.lengths[segment.row]
            cache.tokens[segment.row, committed : committed + segment.count] = tokens[start:end]
            ids = cache.tokens[segment.row, : committed + segment.count].tolist()
            logits += [self.next_logits(ids[:length]) for length in range(committed + 1, len(ids) + 1)]
        return ForwardOutput(torch.stack(logits))

    def next_logits(self, ids: list[int]) -> torch.Tensor:  # [vocab]
        logits = torch.zeros(len(self.tokenizer))
        so_far = self.tokenizer.decode(ids)
        if self.text.startswith(so_far):
            rest = self.text[len(so_far):]
            best = next((i for piece, i in self.pieces if piece and rest.startswith(piece)), None)
            if best is not None:
                logits[best] = 10.0
        return logits


def test_translation_lines_up_token_boundaries(bpe_pairs):
    """A draft that always guesses the right text: nearly every translated token is accepted, so
    the look-behind windows put the boundaries where the target's tokenizer puts them."""
    target, draft = bpe_pairs[False]["target"], bpe_pairs[False]["draft"]
    expected = SpeculativeDecoder(target).generate(PROMPTS[0], max_new_tokens=48)
    text = target.tokenizer.decode(expected.prompt_ids + expected.token_ids)
    oracle = LanguageModel(TextOracleNetwork(draft.tokenizer, text), draft.tokenizer, "oracle",
                           len(draft.tokenizer), max_context=256)
    drafter = make_drafter("model", oracle, target=target)
    got = SpeculativeDecoder(target, drafter, gamma=4).generate(PROMPTS[0], max_new_tokens=48)
    assert got.token_ids == expected.token_ids
    assert got.stats.alpha > 0.75, got.stats  # 0.80 measured: the random target splits text unlike its BPE
    assert got.stats.source_kept > 0.8 * got.stats.source_drafted


def hand_made_bpe(merges: list[tuple[str, str]], order: str):
    """A BPE over the characters of ``order`` (ids in that order) and the given merges."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {character: index for index, character in enumerate(order)}
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["intersection", "point-mass"])
def test_sampling_with_another_tokenizer_keeps_the_targets_law(rule):
    """Tiny vocabularies whose strings overlap partly (target: a b c ab abc; draft: c b a bc ca):
    the law of 3 sampled target tokens, enumerated from the target alone, against 3000 seeded
    speculative samples (chi-square), for both vocabulary rules."""
    target_tokenizer = hand_made_bpe([("a", "b"), ("ab", "c")], "abc")
    draft_tokenizer = hand_made_bpe([("b", "c"), ("c", "a")], "cba")
    target = dataclasses.replace(table_model(5, seed=3, sharpness=1.0), tokenizer=target_tokenizer)
    draft = dataclasses.replace(table_model(5, seed=4, sharpness=2.0), tokenizer=draft_tokenizer)
    assert isinstance(make_drafter("model", draft, target=target), TranslatingDrafter)
    drafter = TranslatingDrafter(draft, target, vocab_rule=rule)
    sampling, prompt, length = SamplingParams(temperature=0.9, top_k=4), target_tokenizer.encode("abca"), 3
    law = {}
    for sequence in itertools.product(range(5), repeat=length):
        probability = 1.0
        for step in range(length):
            logits = target.network.logits(prompt + list(sequence[:step]))
            probability *= float(logits_to_probs(logits[None].double(), sampling)[0, sequence[step]])
        law[sequence] = probability
    counts, accepted, drafted = sample_sequences(SpeculativeDecoder(target, drafter, gamma=3), prompt, sampling,
                                                 length, samples=3000)
    assert 0 < accepted < drafted  # guesses were both accepted and rejected
    assert_matches_law(counts, law, "translated draft")


def test_padded_embedding_with_the_same_tokenizer_drafts_directly(tiny_pair, model_dir):
    """The draft's embedding has 128 rows, the target's 96, one tokenizer: no translation, q over
    the target's rows, and the target's greedy output."""
    from transformers import AutoModelForCausalLM

    folder = model_dir / "padded-draft"
    model = AutoModelForCausalLM.from_pretrained(str(tiny_pair["perturbed"]), dtype=torch.float32)
    model.resize_token_embeddings(128, mean_resizing=False)
    model.save_pretrained(str(folder))
    save_char_tokenizer(folder, 96)
    target, draft = load(tiny_pair["target"]), load(folder)
    assert draft.vocab_size == 128 and target.vocab_size == 96
    drafter = make_drafter("model", draft, target=target)
    assert isinstance(drafter, ModelDrafter) and drafter.vocab_size == 96  # drafts directly, not translated
    with pytest.raises(ValueError, match="look_behind"):
        TranslatingDrafter(draft, target, look_behind=0)
    with pytest.raises(ValueError, match="unknown vocabulary rule"):
        TranslatingDrafter(draft, target, vocab_rule="nearest")
    prompts = [[5, 6, 7], [9, 40, 41, 42]]
    expected = SpeculativeDecoder(target).generate(prompts, max_new_tokens=24)
    got = SpeculativeDecoder(target, draft, gamma=4).generate(prompts, max_new_tokens=24)  # a model: paired alike
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert all(r.stats.accepted > 0 and r.stats.source_drafted == 0 for r in got)  # a perturbed copy: agrees partly
    sampled = SpeculativeDecoder(target, drafter, gamma=4).generate(prompts[0], temperature=1.0, seed=1,
                                                                     max_new_tokens=8)
    assert len(sampled.token_ids) == 8


def test_another_tokenizer_is_refused_where_it_cannot_be_translated(bpe_pairs, model_dir):
    target, draft = bpe_pairs[False]["target"], bpe_pairs[False]["draft"]
    for kind in ("staged", "tree"):
        with pytest.raises(ValueError, match=r"different tokenizers.*only the 'model' drafter translates"):
            make_drafter(kind, draft, target=target)
    bare = load(save_random_model(model_dir / "bare-draft", "llama", seed=5, tokenizer=False, vocab_size=64))
    with pytest.raises(ValueError, match=r"vocabularies differ \(64 vs 120 tokens\).*without a tokenizer"):
        SpeculativeDecoder(target, bare)


REAL_MODELS = Path(os.environ["SPECDEC_REAL_MODELS"]) if os.environ.get("SPECDEC_REAL_MODELS") else None


@pytest.mark.real_models
@pytest.mark.skipif(REAL_MODELS is None, reason="set SPECDEC_REAL_MODELS to the folder fetch.sh wrote")
def test_smollm2_drafts_for_qwen_coder_through_text():
    """The real cross-tokenizer pair: SmolLM2-135M-Instruct (49152 tokens) drafting for
    Qwen2.5-Coder-1.5B-Instruct (151936 rows) gives the target's own greedy output."""
    target = load(REAL_MODELS / "qwen2.5-coder-1.5b", quantize="int8")
    draft = load(REAL_MODELS / "smollm2-135m")
    assert isinstance(make_drafter("model", draft, target=target), TranslatingDrafter)
    prompts = ["def quicksort(items):", "class LRUCache:\n    def __init__(self, capacity):"]
    expected = SpeculativeDecoder(target).generate(prompts, max_new_tokens=32)
    got = SpeculativeDecoder(target, draft, gamma=5).generate(prompts, max_new_tokens=32)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert all(r.stats.alpha > 0.2 and r.stats.source_kept > 0 for r in got), [r.stats.alpha for r in got]
