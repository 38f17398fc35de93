"""`specdec train` smoke test: a few steps on a tiny corpus, both models, save and reload."""

import json

import torch

from specdec import SpeculativeDecoder, load
from specdec.commands.cli import main


def write_corpus(folder, files=12):
    folder.mkdir()
    for index in range(files):
        body = "\n".join(
            f"def function_{index}_{j}(value):\n    \"\"\"Return value plus {j}.\"\"\"\n    return value + {j}\n"
            for j in range(30)
        )
        (folder / f"module_{index}.py").write_text(body)
    (folder / "notes.txt").write_text("not python: skipped")


def test_train_pair_end_to_end(tmp_path):
    corpus, out = tmp_path / "corpus", tmp_path / "run"
    write_corpus(corpus)
    arguments = ["train", "--data", str(corpus), "--out", str(out), "--vocab-size", "300", "--seq-len", "32",
                 "--batch-size", "4", "--heldout-fraction", "0.25", "--eval-every", "5", "--checkpoint-every", "5",
                 "--target-hidden", "32", "--target-layers", "2", "--target-heads", "2", "--target-kv-heads", "1",
                 "--target-intermediate", "64", "--target-steps", "10",
                 "--draft-hidden", "16", "--draft-layers", "1", "--draft-heads", "2", "--draft-kv-heads", "1",
                 "--draft-intermediate", "32", "--draft-steps", "6"]
    assert main(arguments) == 0
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["target"]["total_steps"] == 10 and summary["draft"]["total_steps"] == 6
    assert summary["heldout_files"] >= 1 and summary["train_files"] >= 1
    assert (out / "loss_curves.png").stat().st_size > 1000
    assert "held-out cross-entropy" in (out / "target" / "README.md").read_text()
    # the training loss fell, and both folders load in specdec and in transformers
    first, last = summary["target"]["eval_loss"][0], summary["target"]["eval_loss"][-1]
    assert last < first
    target, draft = load(out / "target"), load(out / "draft")
    assert target.vocab_size == draft.vocab_size == len(target.tokenizer)
    result = SpeculativeDecoder(target, draft, gamma=3).generate("def function_1_2(value):", max_new_tokens=8)
    assert (
        result.token_ids == SpeculativeDecoder(target).generate("def function_1_2(value):", max_new_tokens=8).token_ids
    )
    from transformers import AutoModelForCausalLM

    assert isinstance(AutoModelForCausalLM.from_pretrained(str(out / "draft")), torch.nn.Module)

    # --resume picks up from the checkpoints: nothing left to train, same result
    assert main([*arguments, "--resume"]) == 0
    assert json.loads((out / "training_summary.json").read_text())["target"]["total_steps"] == 10


def test_distil_a_draft_from_a_teachers_layers(tmp_path):
    """`specdec train --teacher`: the draft starts as the chosen layers, only they are trained and
    saved; assembled with the teacher's embedding it loads, and speculation with it is lossless."""
    from safetensors.torch import load_file
    from tiny import save_random_model
    from transformers import AutoModelForCausalLM

    from specdec.models.building import LAYERS_FILE, assemble_draft
    from specdec.training.distill import layer_subset

    teacher_dir = save_random_model(tmp_path / "teacher", num_hidden_layers=4, tie_word_embeddings=True)
    teacher = AutoModelForCausalLM.from_pretrained(str(teacher_dir), dtype=torch.float32)
    start = layer_subset(teacher, (0, 3))
    assert torch.equal(start.model.layers[1].mlp.up_proj.weight, teacher.model.layers[3].mlp.up_proj.weight)
    assert not start.model.embed_tokens.weight.requires_grad

    corpus, out = tmp_path / "corpus", tmp_path / "run"
    write_corpus(corpus)
    assert (
        main(
            [
                "train",
                "--teacher",
                str(teacher_dir),
                "--draft-from-layers",
                "0,-1",
                "--data",
                str(corpus),
                "--out",
                str(out),
                "--seq-len",
                "32",
                "--batch-size",
                "2",
                "--heldout-fraction",
                "0.25",
                "--eval-every",
                "3",
                "--checkpoint-every",
                "3",
                "--draft-steps",
                "3",
                "--save-dtype",
                "float32",
                "--draft-output-tokens",
                "24",
            ]
        )
        == 0
    )
    saved = load_file(str(out / "draft" / LAYERS_FILE))
    assert "model.embed_tokens.weight" not in saved and "model.layers.1.mlp.up_proj.weight" in saved
    assert "model.layers.2.mlp.up_proj.weight" not in saved  # two layers: 0 and the last
    assert not torch.equal(saved["model.layers.1.mlp.up_proj.weight"], teacher.model.layers[3].mlp.up_proj.weight)
    source = json.loads((out / "draft" / "draft_source.json").read_text())
    assert source["teacher_layers"] == [0, 3] and source["draft"]["total_steps"] == 3

    from transformers import AutoTokenizer

    assemble_draft(
        out / "draft", teacher.state_dict(), AutoTokenizer.from_pretrained(str(teacher_dir)), tmp_path / "assembled"
    )
    target, draft = load(teacher_dir), load(tmp_path / "assembled")
    assert len(draft.network.layers) == 2
    output = json.loads((tmp_path / "assembled" / "output_tokens.json").read_text())
    assert len(output["token_ids"]) == 24 and 0 < output["heldout_coverage"] <= 1
    assert draft.network.lm_head.token_ids.tolist() == output["token_ids"]  # the loader restricted the head
    prompt = "def function_1_2(value):"
    expected = SpeculativeDecoder(target).generate(prompt, max_new_tokens=10).token_ids
    assert SpeculativeDecoder(target, draft, gamma=3).generate(prompt, max_new_tokens=10).token_ids == expected
