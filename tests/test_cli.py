"""The command line, run in-process on tiny models."""

import json

from specdec.cli import main


def test_generate_streams_text_and_prints_stats(tiny_pair, capsys):
    code = main(["generate", "--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["perturbed"]),
                 "hello", "--max-new-tokens", "12", "--gamma", "3", "--json"])
    captured = capsys.readouterr()
    assert code == 0
    stats = json.loads(captured.out)  # one JSON object on stdout, nothing else
    assert stats["generated_tokens"] == 12 or stats["finish_reason"] == "eos"
    assert stats["target_forwards"] >= 1 and stats["drafted"] > 0
    assert isinstance(stats["text"], str)
    code = main(["generate", "--target", str(tiny_pair["target"]), "hello", "--max-new-tokens", "12", "--no-draft"])
    captured = capsys.readouterr()
    assert code == 0 and captured.out.startswith("hello")  # the prompt is echoed before the completion
    assert "finished by" in captured.err


def test_show_colours_tokens_and_no_draft_is_target_only(tiny_pair, capsys):
    code = main(["generate", "--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["target"]),
                 "hi", "--max-new-tokens", "8", "--show"])
    assert code == 0 and "draft" in capsys.readouterr().err  # the legend
    code = main(["generate", "--target", str(tiny_pair["target"]), "--no-draft", "hi", "--max-new-tokens", "8",
                 "--json", "--temperature", "0.9", "--seed", "3"])
    stats = json.loads(capsys.readouterr().out)
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
        stats = json.loads(capsys.readouterr().out)
        assert code == 0 and stats["generated_tokens"] >= 1, (drafter, policy)


def test_prompt_from_a_file_or_stdin_and_chat(tiny_pair, tmp_path, capsys, monkeypatch):
    import io

    from specdec import SpeculativeDecoder, load
    from specdec.text import chat_prompt_ids

    target = load(tiny_pair["target"])
    prompt_file = tmp_path / "prompt.py"
    prompt_file.write_text("def f():\n    return 1\n")
    base = ["generate", "--target", str(tiny_pair["target"]), "--no-draft", "--max-new-tokens", "6", "--json"]
    expected = SpeculativeDecoder(target).generate("def f():\n    return 1\n", max_new_tokens=6).text
    assert main(base + ["--prompt-file", str(prompt_file)]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == expected  # a real newline, not a backslash-n
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"def f():\n    return 1\n")))
    assert main(base + ["-"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == expected
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    chat_expected = SpeculativeDecoder(target).generate(chat_prompt_ids(target.tokenizer, messages), max_new_tokens=6)
    assert main(base + ["hi", "--chat", "--system", "Be brief."]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == chat_expected.text
    assert main(base + ["--prompt-file", str(tmp_path / "nope.txt")]) == 2
    assert "prompt file not found" in capsys.readouterr().err
    assert main(base) == 2 and "no prompt" in capsys.readouterr().err


def test_version_and_python_dash_m():
    import subprocess
    import sys

    import specdec

    output = subprocess.run([sys.executable, "-m", "specdec", "--version"], capture_output=True, text=True, check=True)
    assert output.stdout.strip() == f"specdec {specdec.__version__}"
