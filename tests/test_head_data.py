"""A head's training data: the features recorded while the target writes its own continuations
are the ones a teacher-forced pass over the same text computes, and a run goes on from the
batches it already saved."""

from pathlib import Path

import pytest
import torch

import specdec
from specdec import SamplingParams, SpeculativeDecoder, load
from specdec.drafting.head import default_feature_layers
from specdec.training import head_continuations
from specdec.training.head_continuations import continuation_features, record_continuations
from specdec.training.head_data import extract_features


@pytest.fixture(scope="module")
def float64_target(tiny_pair):
    return load(tiny_pair["target"], dtype="float64")


def test_recorded_features_equal_a_teacher_forced_pass(float64_target):
    """Positions 0 .. length - 1 of each continuation: the prompt's from the prefill, the rest from
    one decode step each. Mutation checked: shifting the recorded rows by one position (the first
    row twice) fails it."""
    target = float64_target
    layers = default_feature_layers(target.network.config.num_layers)
    prompts = [[5, 17, 3, 40], [9, 2, 33, 61, 8, 70, 12]]
    length = 16
    recorded = record_continuations(target, prompts, length, layers)
    assert recorded is not None and recorded.tokens.shape == (2, length)
    alone = SpeculativeDecoder(target)
    for prompt, tokens in zip(prompts, recorded.tokens.tolist(), strict=True):
        result = alone.generate(prompt, SamplingParams(max_new_tokens=length - len(prompt)))
        assert tokens == prompt + result.token_ids  # the target's own greedy continuation
    forced = extract_features(target, recorded.tokens.tolist(), layers)
    torch.testing.assert_close(recorded.features.float(), forced.features.float(), rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(recorded.final.float(), forced.final.float(), rtol=2e-3, atol=2e-3)
    assert torch.equal(recorded.greedy, forced.greedy)
    # In the generated part, the greedy token after a position is the next token of the text.
    assert torch.equal(recorded.greedy[1, 6:-1], recorded.tokens[1, 7:])


def test_continuations_go_on_from_the_saved_batches(float64_target, tmp_path, monkeypatch):
    target = float64_target
    layers = default_feature_layers(target.network.config.num_layers)
    files = [Path(specdec.__file__).parent / "core" / "engine.py", Path(specdec.__file__).parent / "decoder.py"]
    first = continuation_features(target, files, 24, 3, layers, tmp_path, batch=2)
    assert first is not None and len(first) >= 1
    parts = sorted(path.name for path in tmp_path.iterdir())
    assert parts == ["part-000000-2.safetensors", "part-000002-1.safetensors"]  # named by first prompt and count

    def no_generation(*args, **kwargs):
        raise AssertionError("a saved batch was generated again")

    monkeypatch.setattr(head_continuations, "record_continuations", no_generation)
    again = continuation_features(target, files, 24, 3, layers, tmp_path, batch=2)
    assert again is not None and torch.equal(again.tokens, first.tokens)
    assert torch.equal(again.features, first.features)
    # Fewer: the first whole batch is reused as it is.
    fewer = continuation_features(target, files, 24, 2, layers, tmp_path, batch=2)
    assert fewer is not None and torch.equal(fewer.tokens, first.tokens[: len(fewer)])
    # From a later prompt on (--continuation-start): the batch of prompts 2 and 3 is new and
    # named by its first prompt; prompt 2's continuation is the one generated before.
    monkeypatch.undo()
    later = continuation_features(target, files, 24, 2, layers, tmp_path, batch=2, start=2)
    assert "part-000002-2.safetensors" in {path.name for path in tmp_path.iterdir()}
    assert later is not None and torch.equal(later.tokens[0], first.tokens[-1])


def test_a_continuation_start_past_the_datas_prompts_is_an_error(float64_target, tmp_path):
    """Two files give four prompts (two per file). Asking to start past them once trained a head
    on corpus windows alone, silently; now it is an error, and a short supply is said."""
    target = float64_target
    layers = default_feature_layers(target.network.config.num_layers)
    files = [Path(specdec.__file__).parent / "core" / "engine.py", Path(specdec.__file__).parent / "decoder.py"]
    with pytest.raises(ValueError, match="--continuation-start 4: the data gives 4 prompts"):
        continuation_features(target, files, 24, 2, layers, tmp_path, start=4)
    said: list[str] = []
    continuation_features(target, files, 24, 5, layers, tmp_path, start=3, say=said.append)
    assert said == ["continuations: prompts 3-3, the last the data gives (1 of the 5 asked for)"]


def test_training_corpora_leave_out_files_that_quote_the_benchmark_suites(tmp_path):
    """A drafter is never trained on the code it is measured on. Mutation: collect_files without
    its quotes_the_suites check keeps quoted.py and this test fails."""
    import json

    from specdec.corpus_files import collect_files, suite_lines
    from specdec.defaults import default_prompts

    prompt = next(item["prompt"] for item in json.loads(default_prompts().read_text())
                  if any(len(line.strip()) >= 30 for line in item["prompt"].splitlines()))
    (tmp_path / "quoted.py").write_text("import os\n\n" + prompt + "    return None\n")
    (tmp_path / "own.py").write_text("def add(a, b):\n    return a + b\n")
    assert suite_lines() and all(len(line) >= 30 for line in suite_lines())
    assert collect_files([tmp_path]) == [tmp_path / "own.py"]
    (tmp_path / "own.py").unlink()
    with pytest.raises(ValueError, match="quote the benchmark suites"):
        collect_files([tmp_path])
