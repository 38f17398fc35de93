"""The corpus drafter: continuations retrieved from a datastore (tokens + suffix array, memory-mapped)
are verified as point masses, so greedy output equals target-only output and sampled output keeps
the target's law, alone and inside auto; the datastore finds what a corpus holds, and refuses a
target of another tokenizer."""

import random

import pytest
import torch
from law import assert_matches_law, sample_sequences
from table_lm import table_model
from test_distribution import PROMPT, exact_sequence_law
from test_greedy_equality import check_equality, lean_models, random_cases  # noqa: F401 (fixture)

from specdec import SamplingParams, SpeculativeDecoder, make_drafter
from specdec.core.drafts import ContextRequest
from specdec.drafting.corpus import CORPUS, CorpusDrafter
from specdec.drafting.datastore import Datastore, tokenizer_fingerprint, write_datastore


def datastore_of(folder, documents: list[list[int]]) -> Datastore:
    write_datastore(folder, documents, "test")
    return Datastore.open(folder, "test")


def test_the_datastore_finds_every_longest_suffix_and_what_followed_it(tmp_path):
    """Against a brute-force scan of the documents, on random contexts over a 5-token alphabet (so
    matches of every length occur, and cross document ends): the longest suffix, how often it
    occurs, and the continuations of all its occurrences, each cut at its document's end.
    Mutation: reading continuations from n - 1 tokens after the match start (an off-by-one in the
    match position) fails the continuations; binary search over lengths starting at n + 1 fails n."""
    rng = random.Random(0)
    documents = [[rng.randrange(5) for _ in range(rng.randint(1, 30))] for _ in range(40)]
    store = datastore_of(tmp_path / "store", documents)
    assert store.meta["tokens"] == sum(map(len, documents)) and store.meta["documents"] == 40
    for _ in range(150):
        context = [rng.randrange(6) for _ in range(rng.randint(1, 9))]  # 5 is in no document
        longest, count = 0, 0
        for n in range(1, min(8, len(context)) + 1):
            pattern = context[-n:]
            found = sum(doc[i : i + n] == pattern for doc in documents for i in range(len(doc) - n + 1))
            if found:
                longest, count = n, found
        n, first, end = store.find(context, max_n=8)
        assert (n, end - first) == (longest, count), context
        if n:
            expected = sorted(doc[i + n : i + n + 3] for doc in documents for i in range(len(doc) - n + 1)
                              if doc[i : i + n] == context[-n:])
            assert sorted(store.continuations(n, first, end, length=3, most=1000)) == expected


def test_a_datastore_built_from_a_tiny_corpus_proposes_the_continuation_planted_there(tmp_path):
    """Files tokenized with a character tokenizer; the context ends with a line's beginning found
    in one file only: the draft is that line's next characters, chain and tree alike.
    Mutation: an off-by-one in the match position (continuations read from n + 1) fails it."""
    from tiny import save_char_tokenizer
    from transformers import AutoTokenizer

    from specdec.corpus_index import build_index

    save_char_tokenizer(tmp_path / "tok", 98)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    source = tmp_path / "repo"
    (source / "pkg").mkdir(parents=True)
    (source / "pkg" / "planted.py").write_text("def planted(alpha, beta): return alpha * beta + 42\n")
    (source / "pkg" / "other.py").write_text("def other(gamma): return gamma - 1\n")
    (source / "notes.txt").write_text("def planted(alpha, beta): return None\n")  # not a .py file: not read
    report = build_index([source], tokenizer, tmp_path / "index")
    assert report.documents == 2 and report.disk_bytes > 0
    store = Datastore.open(tmp_path / "index", tokenizer_fingerprint(tokenizer))
    context = torch.tensor(tokenizer.encode("x = 1\ndef planted(alpha, beta): ret", add_special_tokens=False))
    expected = tokenizer.encode("urn alpha", add_special_tokens=False)
    for tree in (False, True):
        drafter = CorpusDrafter([store], tree=tree, budget=9)
        draft = drafter.propose(ContextRequest.started(drafter, context), 9)
        assert draft.tokens.tolist() == expected and draft.drafter == CORPUS
        assert draft.parents == (None if not tree else tuple(range(-1, 8)))
    # the glob takes other files in place of .py
    assert build_index([source], tokenizer, tmp_path / "notes", globs=["*.txt"]).documents == 1


def test_the_most_frequent_continuation_wins_and_rare_ones_are_left_out(tmp_path):
    """REST's rule with counts as confidence: after [1, 2] the corpus has 3 x 7 8, 1 x 9; the chain
    takes 7 8, the tree holds 7, 8 and 9 (9 is 1 of 4 occurrences: min_share 0.25 keeps it, 0.3 not)."""
    store = datastore_of(tmp_path / "store", [[1, 2, 7, 8], [1, 2, 7, 8], [5, 1, 2, 7, 8], [1, 2, 9]])
    context = torch.tensor([4, 1, 2])
    chain = CorpusDrafter([store])
    assert chain.propose(ContextRequest.started(chain, context), 4).tokens.tolist() == [7, 8]
    tree = CorpusDrafter([store], tree=True, min_share=0.25)
    draft = tree.propose(ContextRequest.started(tree, context), 4)
    assert draft.tokens.tolist() == [7, 8, 9] and draft.parents == (-1, 0, -1)
    strict = CorpusDrafter([store], tree=True, min_share=0.3)
    assert strict.propose(ContextRequest.started(strict, context), 4).tokens.tolist() == [7, 8]
    assert chain.propose(ContextRequest.started(chain, torch.tensor([4, 6])), 4).num_nodes == 0  # no match


def test_a_datastore_of_another_tokenizer_is_refused_in_one_line(tmp_path, tiny_pair, capsys):
    from tiny import save_char_tokenizer
    from transformers import AutoTokenizer

    from specdec.commands.cli import main
    from specdec.corpus_index import build_index

    save_char_tokenizer(tmp_path / "tok", 98)  # the tiny target's has 96 ids: another vocabulary
    (tmp_path / "src.py").write_text("print('hello')\n")
    build_index([tmp_path / "src.py"], AutoTokenizer.from_pretrained(str(tmp_path / "tok")), tmp_path / "index")
    code = main(["generate", "--target", str(tiny_pair["target"]), "hi", "--drafter", "corpus",
                 "--index", str(tmp_path / "index"), "--max-new-tokens", "4"])
    error = capsys.readouterr().err
    assert code == 2 and "another tokenizer" in error and "Traceback" not in error
    assert len([line for line in error.splitlines() if "error:" in line]) == 1
    with pytest.raises(ValueError, match="not a datastore"):
        Datastore.open(tmp_path)


def test_index_build_on_the_command_line_then_generate_with_it(tmp_path, tiny_pair, capsys):
    """`specdec index build` with the target's tokenizer, then `generate --index` drafts from it,
    and the text equals the target alone's (--no-draft)."""
    from specdec.commands.cli import main

    target = str(tiny_pair["target"])
    (tmp_path / "code.py").write_text("def hello(name): return 'hello ' + name\n" * 3)
    assert main(["index", "build", str(tmp_path / "code.py"), "--target", target, "--out", str(tmp_path / "ix")]) == 0
    assert "tokens of 1 files" in capsys.readouterr().out
    common = ["generate", "--target", target, "def hello(name): ret", "--max-new-tokens", "12", "--no-echo"]
    assert main([*common, "--drafter", "corpus", "--index", str(tmp_path / "ix")]) == 0
    drafted = capsys.readouterr()
    assert "corpus retrieval from" in drafted.err
    assert main([*common, "--no-draft"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == drafted.out.splitlines()[0]


def test_a_users_index_keeps_a_file_that_quotes_a_benchmark_prompt(tmp_path, tiny_pair, capsys):
    """The benchmark-line filter keeps the suites out of training data and the default datastore,
    never out of a user's own index: a file of theirs that quotes a bundled prompt's line is
    indexed beside the others. Mutation, checked: index build leaving out such files (the old
    rule) counts 1 file."""
    import json

    from specdec.commands.cli import main
    from specdec.corpus_files import quotes_the_suites
    from specdec.defaults import default_prompts

    prompt = next(item["prompt"] for item in json.loads(default_prompts().read_text())
                  if any(len(line.strip()) >= 30 for line in item["prompt"].splitlines()))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "quoted.py").write_text("import os\n\n" + prompt + "    return None\n")
    (tmp_path / "src" / "own.py").write_text("def add(a, b):\n    return a + b\n")
    assert quotes_the_suites(tmp_path / "src" / "quoted.py")
    assert main(["index", "build", str(tmp_path / "src"), "--target", str(tiny_pair["target"]),
                 "--out", str(tmp_path / "ix")]) == 0
    assert "tokens of 2 files" in capsys.readouterr().out


@pytest.mark.skipif(not __import__("pathlib").Path("/proc/self/clear_refs").exists(), reason="Linux's /proc")
def test_the_build_line_reports_the_builds_own_memory_not_the_processs_peak(tmp_path, tiny_pair):
    """The process held 256 MiB before (then freed them): a tiny build's line says a few MiB, not
    the process's peak (it said "peak memory 12845 MiB" for a 20 MiB datastore after a model load).
    Mutation, checked: reporting the process's peak fails it."""
    from transformers import AutoTokenizer

    from specdec.corpus_index import build_index, describe_build

    held = bytearray(256 << 20)
    held[:: 4096] = b"x" * len(held[:: 4096])  # every page touched: resident
    del held
    (tmp_path / "code.py").write_text("def hello(name): return 'hello ' + name\n" * 3)
    report = build_index([tmp_path / "code.py"], AutoTokenizer.from_pretrained(str(tiny_pair["target"])),
                         tmp_path / "ix")
    assert report.memory_bytes is not None and report.memory_bytes < 64 << 20
    assert "MiB of memory at its peak" in describe_build(report, tmp_path / "ix")


def greedy_outputs(target, count: int, seed: int) -> list[list[int]]:
    """The target's own greedy continuations of random prompts: a corpus the target agrees with."""
    decoder = SpeculativeDecoder(target)
    return [prompt + decoder.generate(prompt, max_new_tokens=length).token_ids
            for prompt, length, _ in random_cases(seed, target.vocab_size, count)]


@pytest.mark.slow
def test_corpus_drafters_and_auto_with_a_corpus_equal_target_only(lean_models, tmp_path):  # noqa: F811
    """200 random prompts through the corpus drafters (chain and tree) and auto holding them; the
    datastore holds the target's own outputs on other prompts and random documents, so drafts are
    partly right: some accepted, some not."""
    target, _ = lean_models
    rng = random.Random(3)
    documents = greedy_outputs(target, 40, seed=11) + [[rng.randrange(target.vocab_size) for _ in range(30)]
                                                       for _ in range(20)]
    store = datastore_of(tmp_path / "store", documents)
    drafters = {"corpus": CorpusDrafter([store]), "corpus-tree": CorpusDrafter([store], tree=True, budget=6),
                "auto": make_drafter("auto", target=target, corpus=[store])}
    counts = check_equality(target, {"corpus": drafters["corpus"], "corpus-tree": drafters["corpus-tree"]}, "fixed")
    counts.update(check_equality(target, {"auto": drafters["auto"]}, "auto"))
    assert all(0 < accepted < drafted for accepted, drafted in counts.values()), counts
    assert [c.name for c in drafters["auto"].candidates] == ["suffix", "ngram", "ngram-edit", "prediction", "corpus"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["corpus", "corpus-tree", "auto"])
def test_corpus_law_of_three_tokens(kind, tmp_path):
    """10k seeded 3-token samples against the enumerated target law, the datastore holding random
    documents over the 6-token vocabulary (retrieved guesses: point masses, right now and then)."""
    vocab, length, samples = 6, 3, 10000
    sampling = SamplingParams(temperature=0.9)
    target = table_model(vocab, seed=100)
    rng = random.Random(5)
    store = datastore_of(tmp_path / "store", [[rng.randrange(vocab) for _ in range(40)] for _ in range(10)])
    drafter = make_drafter(kind, tree_budget=6, corpus=[store])
    decoder = SpeculativeDecoder(target, drafter, gamma=3, policy="auto" if kind == "auto" else None)
    law = exact_sequence_law(target, PROMPT, length, sampling)
    counts, accepted, drafted = sample_sequences(decoder, PROMPT, sampling, length, samples)
    assert 0 < accepted < drafted
    assert_matches_law(counts, law)


def test_auto_judges_the_corpus_but_keeps_it_out_of_the_reach_classes(tmp_path):
    """The reach class reads the copies of the request's own text only: a corpus draft of one token
    leaves the step where the suffix and n-gram copies (8+ tokens) put it, and the corpus's guess
    is judged in that class. Mutation: sets_reach True for the corpus candidate drops the class to 0."""
    from specdec.core.drafts import StepOutcome

    store = datastore_of(tmp_path / "store", [[1, 2, 3, 4, 5, 6, 7], [30, 31]])
    auto = make_drafter("auto", corpus=[store])
    seen = list(range(1, 14))
    request = ContextRequest.started(auto, torch.tensor(seen * 2 + seen[:6]))
    auto.propose(request, 8)
    names = [c.name for c in auto.candidates]
    shadows = dict(zip(names, request.draft_state.shadows, strict=True))
    assert shadows["corpus"] == [7] and all(len(shadows[name]) >= 8 for name in ("suffix", "ngram"))
    assert request.draft_state.reach_class == 2
    auto.observe(request, StepOutcome(torch.tensor([7, 8, 9]), 0))  # the corpus's guess was right
    corpus = names.index("corpus")
    # its class: the step's reach class 2, its own one-token reach 0 (class 2 * 3 + 0)
    assert [len(estimate.accepted_given_reached) for estimate in request.draft_state.acceptance[corpus]] == [
        1 if index == 6 else 0 for index in range(9)]


def test_corpus_tokens_are_marked_and_counted(tmp_path):
    """--show marks accepted corpus tokens, and auto's stats count the corpus's steps; a corpus
    the target agrees with is accepted."""
    from specdec.text import TokenSource

    target = table_model(12, seed=3, max_context=128)
    prompt = [0, 1, 2, 3]
    output = SpeculativeDecoder(target).generate(prompt, max_new_tokens=40).token_ids
    store = datastore_of(tmp_path / "store", [[9, *prompt, *output]])
    decoder = SpeculativeDecoder(target, CorpusDrafter([store]), gamma=4)
    chunks = list(decoder.stream(prompt, SamplingParams(max_new_tokens=40)))
    result = chunks[-1].result
    assert result is not None and result.token_ids == output
    marked = sum(source == TokenSource.CORPUS for chunk in chunks for source in chunk.sources)
    assert marked == result.stats.accepted > 0 and result.stats.by_drafter[CORPUS][2] == marked


def test_a_code_target_gets_the_default_datastore_built_once_and_none_turns_it_off(tmp_path, monkeypatch):
    """The default datastore is built on first use (a line says so), then read from the cache (no
    line); a target without "code" in its name gets none unasked; --index none is none.
    Mutation: building whenever it is asked (no cache check) fails the second call's silence."""
    from types import SimpleNamespace

    from tiny import save_char_tokenizer
    from transformers import AutoTokenizer

    import specdec.corpus_index as corpus_index

    save_char_tokenizer(tmp_path / "tok", 96)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    (tmp_path / "lib" / "test").mkdir(parents=True)
    (tmp_path / "lib" / "shutil.py").write_text("def copy(src, dst): return dst\n")
    (tmp_path / "lib" / "test" / "test_shutil.py").write_text("assert copy(1, 2) == 2\n")  # tests: left out
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(corpus_index, "standard_library", lambda: [tmp_path / "lib"])
    coder = SimpleNamespace(name="tiny-Coder", tokenizer=tokenizer)
    chat = SimpleNamespace(name="tiny", tokenizer=tokenizer)
    said: list[str] = []
    first = corpus_index.datastores_for(None, coder, said.append)
    assert len(first) == 1 and first[0].meta["documents"] == 1 and any("building" in line for line in said)
    said.clear()
    again = corpus_index.datastores_for(None, coder, said.append)
    assert again[0].folder == first[0].folder and not any("building" in line for line in said)
    assert corpus_index.datastores_for(None, chat, said.append) == []
    assert corpus_index.datastores_for(["none"], coder, said.append) == []
    assert len(corpus_index.datastores_for(["default"], chat, said.append)) == 1


def test_bench_runs_auto_with_and_without_the_datastores(tmp_path, monkeypatch):
    """`bench --methods auto auto@noindex`: the same drafter with and without the corpus candidate.
    Mutation: ignoring the @noindex flag fails it."""
    import specdec.bench.suite as suite

    monkeypatch.setattr(suite, "speculative_method", lambda name, decoder, **options: decoder.engine.drafter)
    store = datastore_of(tmp_path / "store", [[1, 2, 3]])
    target = table_model(6, seed=1)
    names = {name: [c.name for c in suite.make_method(name, target, None, None, corpus=[store]).candidates]
             for name in ("auto", "auto@noindex")}
    assert "corpus" in names["auto"] and "corpus" not in names["auto@noindex"]
