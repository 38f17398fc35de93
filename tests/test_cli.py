"""The command line, run in-process on tiny models."""

import json

from specdec.cli import main


def test_generate_streams_text_and_prints_stats(tiny_pair, capsys):
    code = main(["generate", "--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["perturbed"]),
                 "hello", "--max-new-tokens", "12", "--gamma", "3", "--json"])
    captured = capsys.readouterr()
    assert code == 0
    stats = json.loads(captured.err[captured.err.index("{"):])
    assert stats["generated_tokens"] == 12 or stats["finish_reason"] == "eos"
    assert stats["target_forwards"] >= 1 and stats["drafted"] > 0
    assert captured.out.strip()


def test_show_colours_tokens_and_no_draft_is_target_only(tiny_pair, capsys):
    code = main(["generate", "--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["target"]),
                 "hi", "--max-new-tokens", "8", "--show"])
    assert code == 0 and "draft" in capsys.readouterr().err  # the legend
    code = main(["generate", "--target", str(tiny_pair["target"]), "--no-draft", "hi", "--max-new-tokens", "8",
                 "--json", "--temperature", "0.9", "--seed", "3"])
    stats = json.loads((err := capsys.readouterr().err)[err.index("{"):])
    assert code == 0 and stats["drafted"] == 0 and stats["tau"] == 1.0


def test_errors_are_one_line_not_a_traceback(tmp_path, capsys):
    code = main(["generate", "--target", str(tmp_path / "missing"), "hi"])
    err = capsys.readouterr().err
    assert code == 2 and "model folder not found" in err and "Traceback" not in err


def test_drafter_and_policy_options(tiny_pair, capsys):
    for drafter, policy in [("ngram", "cost"), ("staged", "threshold"), ("model", "heuristic")]:
        code = main(["generate", "--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["perturbed"]),
                     "abcabcabcabc", "--max-new-tokens", "10", "--drafter", drafter, "--policy", policy,
                     "--ngram-max", "3", "--json"])
        stats = json.loads((err := capsys.readouterr().err)[err.index("{"):])
        assert code == 0 and stats["generated_tokens"] >= 1, (drafter, policy)
