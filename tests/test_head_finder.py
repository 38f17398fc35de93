"""Heads found for a target by its identity, never loaded for another; the precision of a user's
model chosen by measurement, cached and announced."""

import json

import pytest
import torch
from tiny import save_random_model

from specdec import load, make_drafter
from specdec.drafting.head_finder import (
    find_head,
    how_auto_finds,
    read_identity,
    target_identity,
    write_identity,
)
from specdec.drafting.head_format import load_head, new_head, save_head
from specdec.models import precision_choice


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("finder")
    same_shape = save_random_model(root / "other", "llama", seed=9, init_scale=0.3)
    wider = save_random_model(root / "wider", "llama", seed=0, init_scale=0.3, hidden_size=96)
    return {"target": load(save_random_model(root / "target", "llama", seed=0, init_scale=0.3)),
            "same shape": load(same_shape), "wider": load(wider)}


@pytest.fixture()
def head_folder(targets, tmp_path, monkeypatch):
    target = targets["target"]
    torch.manual_seed(0)
    folder = save_head(new_head(target), tmp_path / "heads" / "mine")
    write_identity(folder, target_identity(target))
    monkeypatch.setenv("SPECDEC_HEADS", str(tmp_path / "heads"))
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    return folder


def test_a_head_is_found_for_its_own_target_only(targets, head_folder):
    assert find_head(targets["target"]) == head_folder
    assert find_head(targets["same shape"]) is None  # same shapes, another embedding
    assert find_head(targets["wider"]) is None


def test_a_run_folder_holds_a_head_auto_finds(targets, tmp_path, monkeypatch):
    """train-head saves a run's head in RUN/head: auto finds it under the cache's heads (the default
    --out) and under a $SPECDEC_HEADS entry naming the run or its parent; the line train-head
    prints after saving says which, or how to make auto find it."""
    target = targets["target"]
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECDEC_HEADS", raising=False)
    torch.manual_seed(0)
    elsewhere = save_head(new_head(target), tmp_path / "runs" / "first" / "head")
    write_identity(elsewhere, target_identity(target))
    assert find_head(target) is None
    assert "$SPECDEC_HEADS" in how_auto_finds(elsewhere, target)
    for entry in (tmp_path / "runs", tmp_path / "runs" / "first"):
        monkeypatch.setenv("SPECDEC_HEADS", str(entry))
        assert find_head(target) == elsewhere
        assert how_auto_finds(elsewhere, target) == "--drafter auto finds it for this target"
    cached = save_head(new_head(target), tmp_path / "cache" / "heads" / "target" / "head")
    write_identity(cached, target_identity(target))
    assert find_head(target) == cached  # the cache is looked in before $SPECDEC_HEADS
    assert f"takes {cached} first" in how_auto_finds(elsewhere, target)


def test_a_head_recording_another_target_is_refused(targets, head_folder):
    with pytest.raises(ValueError, match="another embedding"):
        load_head(head_folder, targets["same shape"])
    with pytest.raises(ValueError, match="hidden_size|width"):
        load_head(head_folder, targets["wider"])
    assert load_head(head_folder, targets["target"]) is not None


def test_a_head_of_another_vocabulary_or_width_is_refused_even_unrecorded(targets, head_folder):
    (head_folder / "target.json").unlink()  # only an explicit --draft-head loads it then: shapes still checked
    assert find_head(targets["target"]) is None
    config = json.loads((head_folder / "config.json").read_text())
    (head_folder / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 1}))
    with pytest.raises(ValueError, match="drafts over"):
        load_head(head_folder, targets["target"])
    (head_folder / "config.json").write_text(json.dumps({**config, "target_hidden_size": 96}))
    with pytest.raises(ValueError, match="width 96"):
        load_head(head_folder, targets["target"])


def test_auto_takes_the_found_head_through_the_command_line(targets, head_folder, capsys):
    from specdec.commands.cli import main

    target = targets["target"].path
    assert main(["generate", "--target", target, "def f(x):", "--max-new-tokens", "8", "--no-echo"]) == 0
    lines = capsys.readouterr().err.splitlines()
    err = " ".join(" ".join(lines).split())
    assert f"draft head found for this target: {head_folder}" in err
    assert any(line.strip().startswith("head: EAGLE-3") for line in lines), lines  # auto's candidates, a line each
    assert main(["generate", "--target", targets["same shape"].path, "x", "--max-new-tokens", "4"]) == 0
    assert "draft head found" not in capsys.readouterr().err


def test_drafter_head_takes_the_found_head_as_auto_does(targets, head_folder, capsys):
    """--drafter head (and head-tree) without --draft-head: the head found for the target, as
    auto finds it; a target with none found gets the one-line error naming --draft-head."""
    from specdec.commands.cli import main

    for kind in ("head", "head-tree"):
        assert main(["generate", "--target", targets["target"].path, "def f(x):", "--drafter", kind,
                     "--max-new-tokens", "6", "--no-echo"]) == 0
        err = " ".join(capsys.readouterr().err.split())
        assert f"draft head found for this target: {head_folder}" in err and "EAGLE-3 head" in err
    assert main(["generate", "--target", targets["same shape"].path, "x", "--drafter", "head"]) == 2
    assert "--draft-head DIR" in capsys.readouterr().err


def test_the_identity_survives_its_file(targets, head_folder):
    assert read_identity(head_folder) == target_identity(targets["target"])
    drafter = make_drafter("auto", target=targets["target"], head=head_folder)
    assert [c.name for c in drafter.candidates][-1] == "head"


def test_the_precision_is_measured_once_and_announced(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(precision_choice, "SMALL_MODEL_PARAMETERS", 0)
    loads = []

    def load_as(quantize):
        loads.append(quantize)
        return load(tiny_pair["target"], quantize=quantize)

    first = precision_choice.choose_precision(str(tiny_pair["target"]), load_as)
    assert first is not None and sorted(loads, key=str) == sorted([None, "int4", "int8"], key=str)
    quantize, line = first
    assert quantize in (None, "int4", "int8")
    assert "--quantize none" in line or quantize is None
    assert "measured once" in line
    again = precision_choice.choose_precision(str(tiny_pair["target"]), load_as)
    assert again == first and len(loads) == 3  # read back, nothing loaded again
    monkeypatch.setattr(precision_choice, "SMALL_MODEL_PARAMETERS", 10**12)
    assert precision_choice.choose_precision(str(tiny_pair["target"]), load_as) is None  # small: float32 stays
