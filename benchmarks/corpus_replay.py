"""Replays drafters on a target's recorded greedy answers, without the target: each step a drafter
proposes from the context so far, the recorded answer says how much of it greedy verification
would accept (the common prefix), and the step is charged a measured verify time T(k). What it
gives is tau, the tokens each auto candidate got accepted, and a tokens-per-second estimate from
the T(k) table, for auto with and without a datastore: a check of the corpus drafter between real
benchmark runs (which it does not replace: it re-encodes the answers' text, and its clock is the
table's, not a run's).

    python benchmarks/corpus_replay.py /work/models/qwen2.5-coder-1.5b \
        docs/benchmarks/auto-epyc-vnni/he20-reach/humaneval_samples.jsonl \
        --verify-ms 1=39.4,2=49.5,3=57.9,5=90.7,8=89.1,12=125.2,16=155.3
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from specdec.bench.humaneval import humaneval_suite, through_chat
from specdec.commands.index import load_tokenizer
from specdec.core.drafts import ContextRequest, StepOutcome
from specdec.corpus_index import datastores_for
from specdec.drafting import make_drafter
from specdec.drafting.model import common_prefix


def verify_seconds_table(spec: str) -> dict[int, float]:
    """T(k) in seconds from "1=39.4,2=49.5,..." (k=milliseconds), or from a JSON file of measured
    blocks ({"rows": [{"ms": {k: ms}}]}, the first row's)."""
    if "=" in spec:
        return {int(k): float(ms) / 1e3 for k, ms in (pair.split("=") for pair in spec.split(","))}
    rows = json.loads(Path(spec).read_text())["rows"]
    return {int(k): ms / 1e3 for k, ms in rows[0]["ms"].items()}


def replay(drafter, prompt: list[int], answer: list[int], cost, gamma: int) -> tuple[float, int, dict]:
    """(seconds, steps, candidate -> accepted tokens) of drafting ``answer`` after ``prompt``."""
    request = ContextRequest.started(drafter, torch.tensor(prompt))
    seconds, steps, done, accepted_by = 0.0, 0, 0, {}
    while done < len(answer):
        draft = drafter.propose(request, min(gamma, len(answer) - done - 1))
        guess = draft.tokens.tolist()
        accepted = common_prefix(guess, answer[done:])
        emitted = answer[done : done + accepted + 1]
        step = cost(len(guess) + 1)
        drafter.observe(request, StepOutcome(torch.tensor(emitted), len(guess), verify_seconds=step,
                                             drafter=draft.drafter))
        request.context = torch.cat([request.context, torch.tensor(emitted)])
        name = draft.drafter or "draft"
        accepted_by[name] = accepted_by.get(name, 0) + accepted
        seconds, steps, done = seconds + step, steps + 1, done + len(emitted)
    return seconds, steps, accepted_by


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", help="a Hugging Face folder or .gguf file (only its tokenizer loads)")
    parser.add_argument("samples", help="a bench run's humaneval_samples.jsonl (its greedy answers)")
    parser.add_argument("--method", default="target-only", help="whose answers to replay")
    parser.add_argument("--verify-ms", required=True, help="T(k): k=ms pairs, \"1=39.4,2=49.5,...\", or a JSON "
                        "file {\"rows\": [{\"ms\": {k: ms}}]}")
    parser.add_argument("--index", action="append", help="datastores, as generate's --index (default: default)")
    parser.add_argument("--gamma", type=int, default=12)
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.target, trust_remote_code=False)
    table = verify_seconds_table(args.verify_ms)
    sizes = sorted(table)
    cost = lambda k: float(np.interp(k, sizes, [table[s] for s in sizes]))  # noqa: E731
    answers = {row["task_id"]: row["output"] for row in map(json.loads, Path(args.samples).read_text().splitlines())
               if row["method"] == args.method}
    prompts = {p.id: p.text for p in through_chat(humaneval_suite(), tokenizer) if p.id in answers}
    target = SimpleNamespace(tokenizer=tokenizer, name="replay")
    corpus = datastores_for(args.index or ["default"], target, print)
    print(f"{len(answers)} answers of {args.method}; T(1) {cost(1) * 1e3:.1f} ms, T(13) {cost(13) * 1e3:.1f} ms")
    for label, datastores in (("auto, no datastore", []), ("auto with the datastore", corpus)):
        drafter = make_drafter("auto", target=target, corpus=datastores)  # one drafter: the pooled estimates carry
        seconds, steps, tokens, accepted_by = 0.0, 0, 0, {}
        for task, answer_text in answers.items():
            answer = tokenizer.encode(answer_text, add_special_tokens=False)
            prompt = tokenizer.encode(prompts[task], add_special_tokens=False)
            spent, taken, by = replay(drafter, prompt, answer, cost, args.gamma)
            seconds, steps, tokens = seconds + spent, steps + taken, tokens + len(answer)
            for name, count in by.items():
                accepted_by[name] = accepted_by.get(name, 0) + count
        print(f"{label}: tau {tokens / steps:.2f}, {tokens / seconds:.1f} tok/s by the table "
              f"(target alone {1 / cost(1):.1f}); accepted tokens by candidate: {accepted_by}")


if __name__ == "__main__":
    main()
