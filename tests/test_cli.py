"""The command line, run in-process on tiny models."""

import json

import pytest

from specdec.commands import cli
from specdec.commands.cli import main


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
    shown = capsys.readouterr()
    assert code == 0 and "draft" in shown.err  # the legend...
    # ...on a line of its own where both streams meet (2>&1): piped, the text ends without a newline
    assert not shown.out.endswith("\n") and "\n\ntokens:" in shown.err
    code = main(["generate", "--target", str(tiny_pair["target"]), "--no-draft", "hi", "--max-new-tokens", "8",
                 "--json", "--temperature", "0.9", "--seed", "3"])
    stats = json.loads(capsys.readouterr().out)
    assert code == 0 and stats["drafted"] == 0 and stats["tau"] == 1.0


def test_no_progress_bar_frames_when_stderr_is_not_a_terminal(monkeypatch, capsys):
    """transformers' and huggingface_hub's tqdm bars (a GGUF's conversion, a folder's weights)
    would write carriage-return frames into a log; every command runs with them off when stderr
    is not a terminal (as under capsys), and they come back after. Mutation, checked: main without
    library_bars_off_unless_terminal fails it."""
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers.utils import logging as transformers_logging

    import specdec.commands.cli as cli

    for _ in transformers_logging.tqdm(range(3)):  # (the bar draws, unless off)
        pass
    assert "\r" in capsys.readouterr().err
    seen = []

    def command(args, console, errors):
        for _ in transformers_logging.tqdm(range(3)):
            pass
        seen.append((transformers_logging.is_progress_bar_enabled(), are_progress_bars_disabled()))
        return 0

    monkeypatch.setattr(cli, "run_command", command)
    assert main(["generate", "hi"]) == 0
    assert seen == [(False, True)] and "\r" not in capsys.readouterr().err
    assert transformers_logging.is_progress_bar_enabled() and not are_progress_bars_disabled()


def test_the_quantize_help_says_what_an_unset_quantize_does(tiny_pair, monkeypatch):
    """Each case the help names, against resolve_models: a small folder keeps float32 unmeasured;
    a larger one gets the measured fastest exact precision; another backend gets none."""

    from rich.console import Console

    import specdec.models.precision_choice as precision_choice
    from specdec.commands.cli import build_parser
    from specdec.commands.models import resolve_models

    parser = build_parser()
    generate = next(action for action in parser._subparsers._group_actions[0].choices["generate"]._actions
                    if "--quantize" in action.option_strings)
    target = str(tiny_pair["target"])

    def quantize_for(*options: str) -> str | None:
        args = parser.parse_args(["generate", "--target", target, *options, "x"])
        return resolve_models(args, Console(stderr=True))[2]

    assert "under 50M parameters keeps float32" in generate.help and quantize_for() is None
    monkeypatch.setattr(precision_choice, "worth_measuring", lambda path: True)
    monkeypatch.setattr(precision_choice, "choose_precision", lambda *a: ("int4", "int4: fastest and exact here"))
    assert "the fastest precision whose verify blocks are exact here" in generate.help and quantize_for() == "int4"
    assert "none on another backend" in generate.help and quantize_for("--backend", "transformers") is None


def test_the_drafting_help_says_what_unset_options_do():
    """--drafter, --policy, --gamma and --tree-budget: what each help says runs when it is unset,
    against what the SpeculationConfig built from that command line runs."""
    from specdec.commands.cli import build_parser
    from specdec.config import SpeculationConfig
    from specdec.names import AUTO_GAMMA, GAMMA, THRESHOLD_GAMMA, TREE_BUDGET, TREE_COST_MAX_BUDGET

    parser = build_parser()
    helps = {option: action.help for action in
             parser._subparsers._group_actions[0].choices["generate"]._actions for option in action.option_strings}

    def config(*options: str) -> SpeculationConfig:
        args = parser.parse_args(["generate", *options, "x"])
        args.argv = list(options)
        return SpeculationConfig.from_args(args)

    assert "(default: auto)" in helps["--drafter"] and config().drafter == "auto"
    assert "default: auto for the auto drafter, tree-cost for trees, else fixed" in helps["--policy"]
    assert (config().chosen_policy, config("--tree").chosen_policy, config("--drafter", "ngram").chosen_policy) == \
        ("auto", "tree-cost", "fixed")
    assert f"default: {AUTO_GAMMA} for auto, {THRESHOLD_GAMMA} for threshold, else {GAMMA}" in helps["--gamma"]
    assert (config().chosen_gamma, config("--drafter", "staged", "--policy", "threshold").chosen_gamma,
            config("--drafter", "ngram").chosen_gamma) == (AUTO_GAMMA, THRESHOLD_GAMMA, GAMMA)
    assert f"default {TREE_BUDGET}" in helps["--tree-budget"] and config("--tree").nodes == TREE_BUDGET
    assert f"unset: {TREE_COST_MAX_BUDGET}" in helps["--tree-budget"]
    assert "none: the target alone, as --no-draft" in helps["--drafter"]
    assert config("--drafter", "none") == config("--no-draft")


@pytest.mark.parametrize("argv, message", [
    (["serve", "--policy", "cost"], "--policy does not apply to a server"),
    (["bench-serve", "--policy", "threshold"], "--policy does not apply to a server"),
    (["generate", "x", "--drafter", "ngram", "--policy", "auto"], "--policy auto is the auto drafter's own"),
    (["generate", "x", "--tree", "--policy", "auto"], "--policy auto is the auto drafter's own"),
    (["generate", "x", "--policy", "cost"], "--policy cost does not apply to --drafter auto"),
    (["serve", "--drafter", "auto", "--tree"], "--tree does not apply to --drafter auto"),
    (["generate", "x", "--drafter", "ngram", "--tree-budget", "8"], "--tree-budget does not apply to --drafter ngram"),
    (["generate", "x", "--drafter", "suffix", "--draft-head", "DIR"], "--draft-head does not apply to --drafter"),
    (["generate", "x", "--drafter", "suffix", "--ngram-max", "3"], "--ngram-max does not apply to --drafter suffix"),
    (["generate", "x", "--drafter", "model", "--index", "default"], "--index does not apply to --drafter model"),
    (["generate", "x", "--no-draft", "--gamma", "3"], "--gamma does not apply without a drafter"),
    (["generate", "x", "--drafter", "none", "--policy", "cost"], "--policy does not apply without a drafter"),
    (["generate", "x", "--no-draft", "--drafter", "model"], "--no-draft and --drafter model disagree"),
    (["bench-serve", "--drafter", "none", "--tree-budget", "4"], "--tree-budget does not apply without a drafter"),
])
def test_an_option_that_would_be_ignored_is_refused_in_one_line(argv, message, capsys):
    """Options that used to be accepted and then ignored (serve's --policy: its controller chooses;
    --policy auto beside another drafter: it meant a fixed gamma; a policy beside auto: a second
    decider; --tree with auto, which drafts chains; --tree-budget for chains; a head or n-gram
    setting for a drafter without one; datastores for a drafter that reads none; drafting options
    for the target alone) are errors naming the option, before anything loads."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_drafter_none_is_no_draft(tiny_pair, capsys):
    base = ["generate", "--target", str(tiny_pair["target"]), "hi", "--max-new-tokens", "6", "--json"]
    assert main([*base, "--drafter", "none"]) == 0
    none = json.loads(capsys.readouterr().out)
    assert main([*base, "--no-draft"]) == 0
    assert none == {**json.loads(capsys.readouterr().out), **{k: none[k] for k in none if "seconds" in k or
                                                                k.endswith("per_second") or k == "tpot"}}
    assert none["drafted"] == 0


def test_threshold_caps_drafts_at_the_given_gamma():
    from specdec.core.policy import make_policy
    from specdec.names import default_gamma

    assert make_policy("threshold", 4).next_shape().depth == 4  # it was max(gamma, 8)
    assert make_policy("threshold", default_gamma("threshold")).next_shape().depth == 8  # unset: as before


def test_tree_budget_caps_what_tree_cost_chooses(tiny_pair, monkeypatch, capsys):
    """--tree-budget under tree-cost (which --tree selects) is the most nodes it may choose, its
    starting shape included (its own cap, unset); it used to be overridden by the policy's.
    Mutation, checked: generate passing the policy by name (its own cap of 64) fails it."""
    import specdec.assembly
    from specdec.core.policy import make_policy
    from specdec.names import TREE_COST_MAX_BUDGET

    assert max(d * w for d, w in make_policy("tree-cost", 4, node_budget=6).shapes()) <= 6
    assert make_policy("tree-cost", 4, node_budget=2).next_shape().node_budget == 2
    assert max(d * w for d, w in make_policy("tree-cost", 4).shapes()) <= TREE_COST_MAX_BUDGET
    assert max(d * w for d, w in make_policy("tree-cost", 4).shapes()) > 16  # (so the cap is not moot)
    policies = []

    build_engine = specdec.assembly.build_engine

    def recording(*args, **kwargs):
        engine = build_engine(*args, **kwargs)
        policies.append(engine.new_policy())
        return engine

    monkeypatch.setattr(specdec.assembly, "build_engine", recording)
    assert main(["generate", "--target", str(tiny_pair["target"]), "ab ab", "--drafter", "ngram-tree", "--gamma", "4",
                 "--max-new-tokens", "4", "--tree-budget", "3"]) == 0
    assert policies[0].name == "tree-cost" and policies[0].max_budget == 3


def test_errors_are_one_line_not_a_traceback(tmp_path, capsys):
    code = main(["generate", "--target", str(tmp_path / "missing"), "hi"])
    err = capsys.readouterr().err
    assert code == 2 and "model folder not found" in err and "Traceback" not in err


def test_drafter_and_policy_options(tiny_pair, capsys):
    for drafter, policy in [("ngram", "cost"), ("staged", "threshold"), ("model", "heuristic")]:
        code = main(["generate", "--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["perturbed"]),
                     "abcabcabcabc", "--max-new-tokens", "10", "--drafter", drafter, "--policy", policy,
                     *(["--ngram-max", "3"] if drafter != "model" else []), "--json"])
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


def toy_target() -> str:
    from specdec.defaults import default_model

    return str(default_model("target"))  # a 2048-token context and a byte-level BPE tokenizer


def test_piped_output_is_the_prompt_and_the_text_byte_for_byte(tmp_path, capsys):
    """stdout to a file or pipe: the prompt (200-character lines, a tab, a carriage return) and the
    generated text exactly, no wrapping, no added newline; --no-echo leaves the prompt out."""
    prompt = "x = '" + "a" * 200 + "'\n\tif x:\r\n" + "    y = [" + ", ".join(str(i) for i in range(60)) + "]\n"
    prompt_file = tmp_path / "prompt.py"
    prompt_file.write_bytes(prompt.encode())
    base = ["generate", "--target", toy_target(), "--prompt-file", str(prompt_file), "--max-new-tokens", "16",
            "--no-draft"]
    assert main(base + ["--json"]) == 0
    text = json.loads(capsys.readouterr().out)["text"]
    for extra in ([], ["--show"]):
        assert main(base + extra) == 0
        assert capsys.readouterr().out == prompt + text, extra
    assert main(base + ["--no-echo"]) == 0
    assert capsys.readouterr().out == text


def test_waits_print_a_line_when_stderr_is_not_a_terminal(tiny_pair, capsys):
    """Loading and the --compare rerun of the target alone say what they wait for (a spinner on a
    terminal, a line in a pipe or log)."""
    assert main(["generate", "--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["perturbed"]), "hi",
                 "--max-new-tokens", "4", "--compare"]) == 0
    err = capsys.readouterr().err
    assert "loading models..." in err and "running the target alone on the same prompt, for comparison..." in err


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fails the test if a model is loaded."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the argument error")

    monkeypatch.setattr("specdec.models.loading.load", refuse)


@pytest.mark.parametrize("arguments, message", [
    (["--gamma", "-3"], "--gamma must be >= 0"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--top-p", "2"], "top_p must be in (0, 1]"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be positive"),
    (["--tree-budget", "0"], "--tree-budget must be >= 1"),
    (["--suffix-cache-tokens", "-1"], "--suffix-cache-tokens must be >= 0"),
    (["--ngram-min", "3", "--ngram-max", "2"], "1 <= min <= max"),
    (["--drafter", "model+nope"], "unknown --drafter 'nope'"),
    (["--system", "be brief"], "--system needs --chat"),
], ids=lambda value: value if isinstance(value, str) else None)
def test_argument_errors_come_before_any_model_loads(no_model_loads, capsys, arguments, message):
    code = main(["generate", "--target", toy_target(), "hello", *arguments])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_an_empty_prompt_is_refused_before_loading(no_model_loads, capsys):
    assert main(["generate", "--target", toy_target(), ""]) == 2
    assert "the prompt is empty" in capsys.readouterr().err


def test_a_prompt_too_long_is_refused_before_it_is_echoed(capsys):
    code = main(["generate", "--target", toy_target(), "ab " * 5000, "--no-draft"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "" and "shorten the prompt" in captured.err


@pytest.mark.parametrize("arguments, expected, absent", [
    (["--no-draft"], "alone (no drafter)", "drafter:"),
    (["--drafter", "ngram", "--policy", "cost"], "drafter: n-gram lookup (1-4-grams); cost policy", None),
    (["--tree", "--gamma", "3"], "drafter: draft-model tree", None),
    (["--drafter", "ngram-tree+model", "--policy", "fixed"], "merged into one tree", None),
    (["--quantize", "int8"], "int8, cpu", "float32"),
    (["--dtype", "bfloat16"], "bfloat16, cpu", "int8"),
])
def test_the_banner_says_what_runs(tiny_pair, capsys, arguments, expected, absent):
    """Built from the loaded target and drafter: their names, precision, device, and the policy."""
    code = main(["generate", "--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["perturbed"]), "hi",
                 "--max-new-tokens", "4", "--no-compare", *arguments])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 0 and expected in err, err
    from specdec.models.loading import model_name

    assert f"target {model_name(tiny_pair['target'])} (specdec backend" in err
    assert absent is None or absent not in err.split("tokens per second")[0].split("speculative decoding")[0]


def test_help_shows_each_default_once(capsys):
    for command in ("generate", "serve", "bench-batch", "bench-serve"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "(default: None)" not in text and "(default) (default" not in text, command
        assert "(default: 4)" in text or command != "generate"  # a default the help did not state is shown


def test_parsing_imports_no_torch():
    """--help and argument errors answer at once: building the parser (every command's) and the
    package's import load no torch (the time is measured in the closing note, not asserted)."""
    import subprocess
    import sys

    code = ("import sys, specdec; from specdec.commands.cli import build_parser, check_arguments; "
            "check_arguments(build_parser().parse_args(['generate', 'hi', '--temperature', '0.5'])); "
            "print(sorted(m for m in ('torch', 'transformers', 'fastapi') if m in sys.modules))")
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert output.stdout.strip() == "[]"


def test_int4_says_in_one_line_which_kernel_runs_and_the_output_equals_target_only(tiny_pair, capsys, tmp_path,
                                                                                   monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    common = ["generate", "--target", str(tiny_pair["target"]), "hello", "--max-new-tokens", "12", "--quantize", "int4",
              "--no-echo"]
    assert main([*common, "--draft", str(tiny_pair["perturbed"]), "--gamma", "3"]) == 0
    speculative = capsys.readouterr()
    notices = [line for line in speculative.err.splitlines() if "int4 kernel on this CPU" in line]
    assert len(notices) == 1 and "checked bit for bit" in notices[0]
    assert "(specdec backend, int4, cpu)" in speculative.err  # the banner says the precision that runs
    assert main([*common, "--no-draft"]) == 0
    assert capsys.readouterr().out == speculative.out


@pytest.mark.parametrize("options, quantize", [
    (["--backend", "specdec"], "w8a32"),  # dequantized on the own forward: its weights exactly, float32 arithmetic
    (["--backend", "specdec", "--quantize", "int4"], "int4"),
    (["--backend", "specdec", "--quantize", "none"], None),
    (["--backend", "specdec", "--dtype", "bfloat16"], None),
    (["--backend", "llama.cpp"], None),  # llama.cpp keeps the file's own quantization
])
def test_a_gguf_target_on_the_own_forward_defaults_to_w8a32(options, quantize):
    from rich.console import Console

    from specdec.commands.models import resolve_models

    args = cli.build_parser().parse_args(["generate", "hi", "--target", "model.gguf", *options])
    assert resolve_models(args, Console(quiet=True))[2] == quantize


def test_tables_in_a_log_keep_every_column_whole(capsys):
    """Output that is not a terminal (pytest captures it, as a pipe or a log would) gets every
    column whole (mutation checked: a plain Console() cuts this table to 80 columns, with '…')."""
    from rich.table import Table

    from specdec.progress import output_console

    table = Table()
    for index in range(12):
        table.add_column(f"column {index:02d}")
    table.add_row(*(f"{index}.123456" for index in range(12)))
    output_console().print(table)
    out = capsys.readouterr().out
    assert "…" not in out and all(f"column {index:02d}" in out for index in range(12)), out
