"""A LOSSY output says so wherever its result goes: `generate`'s statistics table and --json,
`bench`'s methods (NAME@ACCEPTANCE), JSON and verdict, and `explain`'s steps (the drafts only the
relaxed rule kept). The --acceptance flag is checked before any model loads."""

import json

import pytest
from test_explain import assert_decision_explains

from specdec.bench.runner import Method, MethodOutput, Prompt, run_side_by_side
from specdec.commands.cli import main
from specdec.core.acceptance import LOSSY_PRESET
from specdec.core.sampling import SamplingParams
from specdec.defaults import default_model
from specdec.explain.record import chain_decision, record_generation
from specdec.explain.steps import step_view
from specdec.models.loading import load

PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add("
LOOSE = "topk:k=20,delta=0"
ANYTHING = "typical:epsilon=0,alpha=0"  # every drafted token the target gives any probability is kept


def generate(target: str, *arguments: str) -> list[str]:
    return ["generate", "--target", target, "--drafter", "ngram", "--max-new-tokens", "24", "--no-compare",
            PROMPT, *arguments]


def test_generate_marks_a_lossy_result(capsys):
    target = str(default_model("target"))
    assert main(generate(target, "--json", "--acceptance", "lossy")) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["acceptance"] == LOSSY_PRESET and payload["lossy"] is True and "relaxed_accepted" in payload
    assert main(generate(target, "--json")) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["acceptance"] == "exact" and payload["lossy"] is False and payload["relaxed_accepted"] == 0
    assert main(generate(target, "--acceptance", LOOSE)) == 0
    table = " ".join(capsys.readouterr().err.split())
    assert f"LOSSY {LOOSE}" in table and "accepted by the relaxed rule" in table
    assert main(generate(target)) == 0
    assert "LOSSY" not in capsys.readouterr().err


def test_a_bad_acceptance_fails_before_any_model_loads(monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the argument error")

    monkeypatch.setattr("specdec.models.loading.load", refuse)
    for command in (generate("unused", "--acceptance", "topk:k=0"), ["serve", "--acceptance", "fuzzy"]):
        with pytest.raises(SystemExit) as exit_code:
            main(command)
        assert exit_code.value.code == 2 and "argument --acceptance" in capsys.readouterr().err


def test_bench_method_flags():
    from specdec.config import SpeculationConfig

    config, flags = SpeculationConfig.from_method("auto@lossy")
    assert (config.draft_forced, config.acceptance, "acceptance" in config.options_given, flags) == (True, LOSSY_PRESET,
                                                                                            True, [])
    config, flags = SpeculationConfig.from_method("ngram:cost@unforced@topk:k=2@noindex")
    assert (config.draft_forced, config.acceptance, flags) == (False, "topk:k=2,delta=0.5", ["noindex"])
    assert "acceptance" not in SpeculationConfig.from_method("auto")[0].options_given  # the run's acceptance then
    with pytest.raises(ValueError, match="the flags are @unforced, @head=DIR, @noindex, @noprediction, @unrelated and "
                                         "@ACCEPTANCE"):
        SpeculationConfig.from_method("ngram:cost@fast")


def test_side_by_side_records_drift_of_lossy_methods_not_a_mismatch():
    def answer(tokens: list[int]):
        return lambda prompt_ids, settings: MethodOutput(tokens, 0.01)

    methods = [Method("target-only", answer([1, 2, 3])), Method("lossy", answer([1, 5, 3]), acceptance=LOOSE),
               Method("same", answer([1, 2, 3]), acceptance=LOOSE)]
    run = run_side_by_side(methods, [Prompt("c", "x")], lambda text: [0], SamplingParams(), "target-only",
                           warmup=False)
    assert run.mismatches == []
    drift = {m.method: (m.drift_checked, m.first_difference) for m in run.measurements}
    assert drift == {"target-only": (False, None), "lossy": (True, 1), "same": (True, None)}


def test_bench_runs_and_marks_a_lossy_method(tmp_path, capsys):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"category": "code", "prompt": PROMPT, "id": "a"}]))
    out = tmp_path / "bench"
    assert main(["bench", "--target", str(default_model("target")), "--prompts", str(prompts), "--methods",
                 "ngram:fixed", f"ngram:fixed@{LOOSE}", "--max-new-tokens", "16", "--repeats", "1",
                 "--out", str(out)]) == 0
    rows = {row["method"]: row for row in json.loads((out / "results.json").read_text())["measurements"]}
    assert "acceptance" not in rows["ngram:fixed"] and "acceptance" not in rows["target-only"]
    lossy = rows[f"ngram:fixed@{LOOSE}"]
    assert lossy["acceptance"] == LOOSE and "first_difference" in lossy and "identical_to_reference" in lossy
    assert f"LOSSY acceptance, not identity-checked: ngram:fixed@{LOOSE}" in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_explain_shows_the_drafts_only_the_relaxed_rule_kept(temperature):
    pair = load(str(default_model("target"))), load(str(default_model("draft")))
    run = record_generation(*pair, "def fibonacci(n):", SamplingParams(temperature=temperature, seed=0,
                                                                       max_new_tokens=24, acceptance=ANYTHING))
    assert sum(len(record.relaxed) for record in run.records) == run.result.stats.relaxed_accepted > 0
    for record in run.records:  # the recorded decision is the engine's, relaxed drafts included
        if temperature:
            assert_decision_explains(record)
        decision = chain_decision(record)
        assert record.draft_tokens[: decision.num_accepted] + [decision.final_token] == record.emitted
        marked = [row.node for row in step_view(record).rows if row.decision.endswith("(relaxed)")]
        assert marked == record.relaxed


def test_a_lossy_methods_pass_at_1_is_its_drift_not_a_disagreement(tmp_path, monkeypatch):
    """On HumanEval, exact methods of one engine must share pass@1; a lossy one is left out of
    that check (its pass@1 is what it costs). A stub marked lossy answers the canonical solutions
    beside target-only. (Mutation checked: counting it among the exact methods names a disagreement.)"""
    from test_humaneval import canonical_solutions

    from specdec.bench import suite

    problems, solutions = suite.suite_prompts("humaneval", None)[:2], canonical_solutions()
    build = suite.build_methods

    def with_lossy_stub(names, target, *args, **kwargs):
        def run(prompt_ids, settings):
            asked = target.tokenizer.decode(prompt_ids)
            task = next(p.task for p in problems if p.task.prompt.strip() in asked)
            return MethodOutput(target.tokenizer.encode(solutions[task.task_id], add_special_tokens=False), 0.01)

        return [*build(names, target, *args, **kwargs), Method("canonical@lossy", run, acceptance="lossy")]

    monkeypatch.setattr(suite, "build_methods", with_lossy_stub)
    out = tmp_path / "bench"
    assert main(["bench", "--target", str(default_model("target")), "--suite", "humaneval", "--limit", "2",
                 "--methods", "target-only", "--max-new-tokens", "8", "--repeats", "1", "--out", str(out)]) == 0
    payload = json.loads((out / "results.json").read_text())
    overall = {s["method"]: s for s in payload["summaries"] if s["category"] == "all"}
    assert overall["canonical@lossy"]["pass_at_1"] == 1.0 != overall["target-only"]["pass_at_1"]
    assert payload["pass_at_1_disagreements"] == []
    assert all(not m["identical_to_reference"] for m in payload["measurements"] if m["method"] == "canonical@lossy")
