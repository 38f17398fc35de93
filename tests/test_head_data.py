"""A head's training data: the features recorded while the target writes its own continuations
are the ones a teacher-forced pass over the same text computes, and a run goes on from the
batches it already saved."""

import re
from pathlib import Path

import pytest
import torch

import specdec
from specdec import SamplingParams, SpeculativeDecoder, load
from specdec.drafting.head import default_feature_layers
from specdec.training import head_continuations
from specdec.training.budget import Budget, BudgetSpent
from specdec.training.feature_parts import FeatureParts
from specdec.training.head_continuations import continuation_features, record_continuations
from specdec.training.head_data import HeadFeatures, draft_vocabulary, extract_features
from specdec.training.head_dataset import DataPlan, prepare


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
    told: list[tuple[int, bool]] = []
    first = FeatureParts(continuation_features(target, files, 24, 3, layers, tmp_path, batch=2,
                                               progress=lambda count, made: told.append((count, made)))).whole()
    assert len(first) >= 1
    assert told == [(2, True), (1, True)]  # each piece told, as made
    parts = sorted(path.name for path in tmp_path.iterdir())
    assert parts == ["part-000000-2.safetensors", "part-000002-1.safetensors"]  # named by first prompt and count

    def no_generation(*args, **kwargs):
        raise AssertionError("a saved batch was generated again")

    monkeypatch.setattr(head_continuations, "record_continuations", no_generation)
    again = FeatureParts(continuation_features(target, files, 24, 3, layers, tmp_path, batch=2,
                                               progress=lambda count, made: told.append((count, made)))).whole()
    assert told[2:] == [(2, False), (1, False)]  # read back: a progress estimate leaves them out
    assert torch.equal(again.tokens, first.tokens)
    assert torch.equal(again.features, first.features)
    # Fewer: the first whole batch is reused as it is.
    fewer = FeatureParts(continuation_features(target, files, 24, 2, layers, tmp_path, batch=2))
    assert torch.equal(fewer.tokens, first.tokens[: len(fewer)])
    # From a later prompt on (--continuation-start): the batch of prompts 2 and 3 is new and
    # named by its first prompt; prompt 2's continuation is the one generated before.
    monkeypatch.undo()
    later = FeatureParts(continuation_features(target, files, 24, 2, layers, tmp_path, batch=2, start=2))
    assert "part-000002-2.safetensors" in {path.name for path in tmp_path.iterdir()}
    assert torch.equal(later.tokens[0], first.tokens[-1])


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


class StopsAfter(Budget):
    """A budget spent after ``pieces`` checks (a session ending at a known point)."""

    def __init__(self, pieces: int) -> None:
        super().__init__(None)
        self.left = pieces

    def spent(self) -> bool:
        self.left -= 1
        return self.left < 0


def small_plan(target) -> DataPlan:
    return DataPlan((str(Path(specdec.__file__).parent / "core"),), 24, 8, 3, 2, 32,
                    default_feature_layers(target.network.config.num_layers), "tiny:float64")


def quiet_bar(label: str, total: int):
    return lambda count, made: None


def test_a_run_stopped_by_its_budget_goes_on_to_the_same_data(float64_target, tmp_path):
    """Stopped after two of its four pieces (held-out continuations, held-out windows, windows,
    continuations), then run again: the data of one uninterrupted run, bit for bit, and the
    pieces saved before the stop are read, not made again."""
    target, plan = float64_target, small_plan(float64_target)
    with pytest.raises(BudgetSpent, match="after 0 of 8 windows"):
        prepare(target, plan, tmp_path / "stopped", print, quiet_bar, StopsAfter(2))
    saved = sorted(path.name for path in (tmp_path / "stopped").rglob("part-*"))
    assert len(saved) == 2
    checks = StopsAfter(10)
    resumed = prepare(target, plan, tmp_path / "stopped", print, quiet_bar, checks)
    assert checks.left == 10 - 2  # only the two pieces not saved were made
    whole = prepare(target, plan, tmp_path / "whole", print, quiet_bar)
    for got, expected in ((resumed[0].whole(), whole[0].whole()), (resumed[1], whole[1])):
        for name in ("tokens", "features", "final", "greedy"):
            assert torch.equal(getattr(got, name), getattr(expected, name)), name
    assert torch.equal(resumed[2], whole[2])


def test_training_stopped_by_its_budget_resumes_to_the_same_weights(float64_target, tmp_path, monkeypatch):
    """A run whose budget ends at step 3 of 6 (after its four data pieces), then the same settings
    again: the weights, optimizer and history of an uninterrupted run, bit for bit."""
    import io

    from rich.console import Console

    from specdec.training import head_train
    from specdec.training.head_settings import HeadTraining

    def settings(out: Path) -> HeadTraining:
        return HeadTraining(out=str(out), data=(str(Path(specdec.__file__).parent / "core"),), steps=6,
                            draft_vocab=32, sequence_length=24, corpus_sequences=8, continuation_sequences=3,
                            heldout_sequences=2, batch_size=4, eval_every=2, checkpoint_every=4, precision="float32")

    whole_log = io.StringIO()
    head_train.train_head(float64_target, settings(tmp_path / "whole"), Console(file=whole_log))
    assert "left at this run's" in " ".join(whole_log.getvalue().split())  # a log's lines say the time left
    monkeypatch.setattr(head_train, "Budget", lambda hours: StopsAfter(4 + 3))
    with pytest.raises(BudgetSpent, match="at step 3 of 6"):
        head_train.train_head(float64_target, settings(tmp_path / "stopped"), Console(file=io.StringIO()))
    assert torch.load(tmp_path / "stopped" / "checkpoint.pt", weights_only=False)["step"] == 3
    monkeypatch.undo()
    resumed_log = io.StringIO()
    head_train.train_head(float64_target, settings(tmp_path / "stopped"), Console(file=resumed_log))
    # Its data read back, the pace is the steps made in this run: none for the data's lines.
    said = " ".join(resumed_log.getvalue().split())  # the console wraps its lines
    assert "s a sequence" not in said
    assert re.search(r"step 4: .* \(0 min left at this run's [0-9.]+ s a step\)", said)
    whole, resumed = (torch.load(tmp_path / run / "checkpoint.pt", weights_only=False) for run in ("whole", "stopped"))
    assert resumed["step"] == whole["step"] == 6 and resumed["history"] == whole["history"]
    for name, tensor in whole["head"].items():
        assert torch.equal(resumed["head"][name], tensor), name


def test_the_installed_files_the_long_and_edit_suites_send_are_left_out():
    """rich/console.py (the long suite) and rich/align.py (predicted edits) never enter training
    data taken from installed packages; rich's other modules do. Mutation: collect_files without
    is_suite_source keeps them."""
    from specdec.corpus_files import collect_files, installed_packages, suite_source_files

    rich = next(root / "rich" for root in installed_packages() if (root / "rich" / "console.py").is_file())
    assert {(rich / "console.py").resolve(), (rich / "align.py").resolve()} <= suite_source_files()
    kept = collect_files([rich], skip_folders={"__pycache__"})
    assert rich / "console.py" not in kept and rich / "align.py" not in kept
    assert rich / "table.py" in kept
    assert rich / "console.py" in collect_files([rich], skip_folders={"__pycache__"}, leave_out_suites=False)


def test_feature_parts_read_the_sequences_their_parts_hold_in_order(tmp_path):
    """Training draws batches from the saved parts without concatenating them: any selection (across
    parts' borders, repeated, out of order, a slice) is what the concatenated data gives."""
    generator = torch.Generator().manual_seed(0)

    def random_part(count: int) -> HeadFeatures:
        return HeadFeatures(torch.randint(0, 50, (count, 6), generator=generator),
                            torch.randn(count, 6, 12, generator=generator).half(),
                            torch.randn(count, 6, 4, generator=generator).half(),
                            torch.randint(0, 50, (count, 6), generator=generator))

    parts = [random_part(count) for count in (3, 1, 4)]
    for index, part in enumerate(parts):
        part.save(tmp_path / f"part-{index}.safetensors")
    stored = FeatureParts([tmp_path / f"part-{index}.safetensors" for index in range(3)])
    whole = HeadFeatures.cat([HeadFeatures.load(path) for path in stored.paths])
    assert len(stored) == 8 and torch.equal(stored.tokens, whole.tokens)
    for rows in (torch.tensor([7, 0, 3, 3, 2, 4]), slice(2, 5), slice(None)):
        got, expected = stored.select(rows), whole.select(rows)
        for name in ("tokens", "features", "final", "greedy"):
            assert torch.equal(getattr(got, name), getattr(expected, name)), name


def test_training_on_a_share_of_the_data_makes_only_that_share(float64_target, tmp_path, monkeypatch):
    """--train-windows / --train-continuations: only the share's pieces are made (whole pieces: the
    same ones a run of the whole plan makes, so they serve it later), and the draft vocabulary is
    the share's. Windows alone plus continuations alone are the whole plan's data."""
    from specdec.training import head_data, head_dataset

    target, plan = float64_target, small_plan(float64_target)
    monkeypatch.setattr(head_dataset, "WINDOWS_A_PART", 4)  # 8 windows: two parts
    monkeypatch.setattr(head_data, "WINDOWS_A_PART", 4)
    checks = StopsAfter(10)
    first, _, vocabulary = prepare(target, plan, tmp_path, print, quiet_bar, checks, (3, 0))
    assert checks.left == 10 - 3  # held-out continuations, held-out windows, one part of windows
    assert len(first) == 4 and torch.equal(vocabulary, draft_vocabulary(first.tokens, 32, target.vocab_size))
    checks = StopsAfter(10)
    every, held, _ = prepare(target, plan, tmp_path, print, quiet_bar, checks)
    assert checks.left == 10 - 2  # the share's parts serve the whole plan: only the second part and
    # the continuations are made
    continued, _, _ = prepare(target, plan, tmp_path, print, quiet_bar, StopsAfter(0), (0, None))
    windows, _, _ = prepare(target, plan, tmp_path, print, quiet_bar, StopsAfter(0), (None, 0))
    assert len(windows) == 8 and len(windows) + len(continued) == len(every)
    assert torch.equal(first.tokens, every.tokens[:4]) and torch.equal(windows.tokens, every.tokens[:8])
    assert torch.equal(continued.tokens, every.tokens[8:])
    from safetensors import safe_open

    with safe_open(str(next(tmp_path.rglob("heldout.safetensors"))), framework="pt") as handle:
        assert handle.metadata() == {"windows": "2"}  # head_heldout.py's split: windows first


def test_saved_parts_hold_hidden_states_in_float8_with_a_scale_per_layer_slice(tmp_path):
    """A part keeps each token's layer slices to float8's precision relative to the slice's largest
    value (a slice of huge outliers does not flatten another layer's small values); token ids and
    greedy tokens exactly; and a float16 part saved before (no scales) reads as it was."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(1)
    hidden = 16
    features = torch.randn(2, 5, 3 * hidden, generator=generator)
    features[..., :hidden] *= 1000.0  # the first layer's slice: outliers three orders larger
    data = HeadFeatures(torch.randint(0, 50, (2, 5), generator=generator), features.half(),
                        torch.randn(2, 5, hidden, generator=generator).half(),
                        torch.randint(0, 50, (2, 5), generator=generator))
    data.save(tmp_path / "part.safetensors")
    back = HeadFeatures.load(tmp_path / "part.safetensors")
    assert torch.equal(back.tokens, data.tokens) and torch.equal(back.greedy, data.greedy)
    for name in ("features", "final"):
        original = getattr(data, name).float().unflatten(-1, (-1, hidden))
        error = (getattr(back, name).float().unflatten(-1, (-1, hidden)) - original).abs().amax(-1)
        assert (error <= original.abs().amax(-1) / 16).all(), name  # e4m3: 3 mantissa bits
    assert (back.features[..., hidden:].float() - data.features[..., hidden:].float()).abs().max() < 0.5
    save_file({name: getattr(data, name).contiguous() for name in ("tokens", "features", "final", "greedy")},
              str(tmp_path / "float16.safetensors"))
    old = HeadFeatures.load(tmp_path / "float16.safetensors")
    assert torch.equal(old.features, data.features) and torch.equal(old.final, data.final)


def test_head_prompts_take_the_kinds_in_turn_two_a_file(tmp_path):
    """Completions, docstrings, bodies, classes and chat requests in turn, never more than two from
    a file, and a stream: the first N prompts are the same for any larger count (saved batches of
    continuations are keyed by their first prompt's number)."""
    from specdec.training.head_prompts import KINDS, head_prompts

    source = (
        "import os\n\n\nclass Box:\n    def __init__(self, size):\n        self.size = size\n\n"
        "    def area(self, scale=1):\n        \"\"\"The box's area.\"\"\"\n"
        "        width = self.size * scale\n        height = self.size * scale\n        return width * height\n"
    )
    files = []
    for index in range(6):
        files.append(tmp_path / f"module{index}.py")
        files[-1].write_text(source.replace("Box", f"Box{index}"))
    prompts = head_prompts(files, 100)
    assert [prompt.kind for prompt in prompts[: len(KINDS)]] == list(KINDS)
    assert all(sum(prompt.file == file for prompt in prompts) <= 2 for file in files)
    assert len(prompts) == 12 and head_prompts(files, 7) == prompts[:7]
    chat = next(prompt for prompt in prompts if prompt.kind == "chat")
    assert "```python\ndef area(self, scale=1):\n    \"\"\"The box's area.\"\"\"\n```" in chat.request  # dedented
    docstring = next(prompt for prompt in prompts if prompt.kind == "docstring")
    assert docstring.text.endswith('    def area(self, scale=1):\n        """')


def test_a_draft_vocabulary_keeps_a_heads_tokens_then_adds_the_most_frequent():
    tokens = torch.tensor([[5, 5, 5, 7, 7, 2, 9, 9, 9, 9], [1, 1, 7, 0, 3, 3, 3, 3, 3, 8]])  # 3: 5x, 9: 4x, 5 and 7: 3x
    assert draft_vocabulary(tokens, 3, 12).tolist() == [3, 5, 9]  # the most frequent (5 before 7: lower id)
    # A head's tokens (even unseen ones: 11) stay; the rest go by frequency, ties to the lower id.
    assert draft_vocabulary(tokens, 5, 12, keep=torch.tensor([0, 11])).tolist() == [0, 3, 5, 9, 11]
    assert draft_vocabulary(tokens, 6, 12, keep=torch.tensor([0, 11])).tolist() == [0, 3, 5, 7, 9, 11]


def test_the_time_left_counts_only_the_pieces_made_in_this_run():
    """Pieces read back from an earlier run take no time: an estimate that counted them would say
    the rest is almost done. Mutation checked: counting read-back pieces in the pace fails it
    (a pace told before any piece was made)."""
    from specdec.training.head_train import PiecePace

    now = [0.0]
    pace = PiecePace(20_000, clock=lambda: now[0])
    assert pace.told(500, made=False) == ""  # nothing made yet: no pace to tell
    now[0] += 36.0
    assert pace.told(100, made=True) == "1.9 h left at this run's 0.36 s a sequence"  # 19,400 x 0.36 s
    now[0] += 1.0
    assert pace.told(19_000, made=False) == "2 min left at this run's 0.36 s a sequence"  # 400 x 0.36 s
    assert pace.told(400, made=True) == ""  # done


@pytest.mark.slow
def test_the_learning_curve_script_trains_and_scores_each_point(tiny_pair, tmp_path):
    """benchmarks/cpu/head_curve.py on the tiny target: one head per point over a shared feature
    cache, each scored on the held-out set; the larger share trains on more tokens; the table,
    curve.json and curve.png written, and a second run reads every point back (resumed, not redone)."""
    import json
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu" / "head_curve.py"
    command = [sys.executable, str(script), "--target", str(tiny_pair["target"]), "--quantize", "none",
               "--features", str(tmp_path / "features"), "--out", str(tmp_path / "curve"),
               "--data", str(Path(specdec.__file__).parent), "--corpus-sequences", "128",
               "--heldout-sequences", "2", "--sequence-length", "32", "--batch-size", "4", "--draft-vocab", "64",
               "--steps", "4", "--points", "64:0", "128:0"]
    first = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    points = json.loads((tmp_path / "curve" / "curve.json").read_text())["points"]
    assert [point["point"] for point in points] == ["64:0", "128:0"]
    assert points[0]["tokens"] < points[1]["tokens"]
    assert all(len(point["library"]) == 4 and all(0 <= a <= 1 for a in point["library"]) for point in points)
    assert (tmp_path / "curve" / "curve.png").stat().st_size > 0
    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and again.stderr.count("resumed from") == 2, again.stderr[-2000:]
    assert json.loads((tmp_path / "curve" / "curve.json").read_text())["points"] == points
