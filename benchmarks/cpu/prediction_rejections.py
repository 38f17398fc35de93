"""Where a `specdec bench` run's drafts were refused, against where the output really leaves the
prediction: the run as the CLI makes it, every step recorded as the engine advances a request
(step_costs.run_with_steps), then each request's output aligned
with its prediction (difflib on token ids: the fewest places any drafter copying the prediction
must miss).

    python benchmarks/cpu/prediction_rejections.py STEPS.json bench --target DIR --suite predicted-edits \\
        --limit 5 --max-new-tokens 2048 --methods auto --repeats 1 --out runs/trace

Prints, per request with a prediction: its output and prediction lengths, the alignment's blocks
(edit sites + 1) and the share of the output they copy, the steps by drafter with the tokens each
emitted and its verify seconds, and the refused steps by (drafter, whether the refused position
is one the alignment copies: True is a miss a better copy would not have had). STEPS.json keeps
every step and each request's output and prediction.
"""

from __future__ import annotations

import collections
import difflib
import json
import sys

from step_costs import run_with_steps  # (this folder: the script's own path comes first)


def record(arguments: list[str]) -> list[dict]:
    """Run the CLI recording every step; each request's steps, output and prediction."""
    steps: dict[int, list[tuple[int, int, int, str | None, float]]] = collections.defaultdict(list)
    finals: dict[int, tuple[list[int], list[int] | None]] = {}

    def on_step(request, outcome, draft_seconds, verify_seconds):
        key, start = id(request), len(request.prompt_ids)
        steps[key].append((request.length - len(outcome.emitted) - start, outcome.num_drafted, outcome.num_accepted,
                           outcome.drafter, verify_seconds))
        prediction = request.sampling.prediction
        finals[key] = (request.tokens[start : request.length].tolist(),
                       list(prediction) if prediction and not isinstance(prediction, str) else None)

    run_with_steps(arguments, on_step)
    return [{"steps": steps[key], "output": finals[key][0], "prediction": finals[key][1]} for key in steps]


def report(request: dict) -> None:
    output, prediction, steps = request["output"], request["prediction"], request["steps"]
    matcher = difflib.SequenceMatcher(None, output, prediction, autojunk=False)
    blocks = [block for block in matcher.get_matching_blocks() if block.size]
    copied = [False] * len(output)
    for block in blocks:
        copied[block.a : block.a + block.size] = [True] * block.size
    by_drafter, emitted, seconds, refused = (collections.Counter() for _ in range(4))
    for position, drafted, accepted, drafter, verify_seconds in steps:
        by_drafter[drafter] += 1
        emitted[drafter] += accepted + 1
        seconds[drafter] += verify_seconds
        if accepted < drafted:
            at = position + accepted
            refused[(drafter, copied[at] if at < len(output) else None)] += 1
    share = sum(block.size for block in blocks) / max(1, len(output))
    print(f"output {len(output)} prediction {len(prediction)}: {len(blocks)} aligned blocks copy {share:.1%}; "
          f"{len(steps)} steps")
    print("  steps", dict(by_drafter), "emitted", dict(emitted),
          "verify s", {drafter: round(total, 1) for drafter, total in seconds.items()})
    print("  refused (drafter, at a copied position)", dict(refused))


def main() -> None:
    out, arguments = sys.argv[1], sys.argv[2:]
    requests = [request for request in record(arguments) if request["prediction"] and request["steps"]]
    with open(out, "w") as file:
        json.dump(requests, file)
    for request in requests:
        if any(step[3] for step in request["steps"]):  # (target-only's requests draft nothing)
            report(request)
    print(f"-> {out}")


if __name__ == "__main__":
    main()
