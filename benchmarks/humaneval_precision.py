"""HumanEval pass@1 of one model in several precisions: what a precision costs in quality, measured.

Each precision's greedy text is produced with `auto` (lossless: the text is that precision's own
target-alone text, only faster, which is what makes float32 affordable on a CPU), through the chat
template as `specdec bench --suite humaneval` does, and run in the same sandbox. Prints pass@1 per
precision, the problems whose verdicts differ, and how many outputs are token-identical.

    python benchmarks/humaneval_precision.py MODEL_DIR [--precisions none int4] [--limit 20] [--out FILE]

(`none` is the checkpoint's float32; a 1.5B model in float32 peaks at ~12.5 GiB while loading.)
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

from specdec import SamplingParams, SpeculativeDecoder, load, make_drafter
from specdec.bench import humaneval as he
from specdec.bench.sandbox import run_program
from specdec.drafting.head_finder import find_head


def outputs_of(model_dir: str, precision: str, limit: int) -> list[dict]:
    target = load(model_dir, quantize=None if precision == "none" else precision)  # none: float32
    decoder = SpeculativeDecoder(target, make_drafter("auto", target=target, head=find_head(target)))
    prompts = he.through_chat(he.humaneval_suite()[:limit], target.tokenizer)
    rows = []
    for prompt in prompts:
        assert prompt.task is not None
        began = time.perf_counter()
        result = decoder.generate(prompt.text, SamplingParams(max_new_tokens=512, stop=prompt.stop))
        seconds = time.perf_counter() - began
        execution = run_program(prompt.task.program(result.text))
        rows.append({"task_id": prompt.task.task_id, "precision": precision, "token_ids": result.token_ids,
                     "passed": execution.passed, "outcome": execution.outcome, "tokens": len(result.token_ids),
                     "seconds": seconds})
        print(f"{precision} {prompt.task.task_id}: {'passed' if execution.passed else execution.outcome} "
              f"({len(result.token_ids)} tokens, {len(result.token_ids) / seconds:.1f} tok/s)", flush=True)
    del decoder, target
    gc.collect()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--precisions", nargs="+", default=["none", "int4"])
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--out", type=Path, help="a JSON file of every output and verdict")
    args = parser.parse_args()
    rows = {precision: outputs_of(args.model_dir, precision, args.limit) for precision in args.precisions}
    first = args.precisions[0]
    print(f"\nHumanEval, first {args.limit} problems, greedy, chat template ({args.model_dir})")
    for precision, results in rows.items():
        passed = sum(row["passed"] for row in results)
        tokens, seconds = sum(row["tokens"] for row in results), sum(row["seconds"] for row in results)
        same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(rows[first], results, strict=True))
        differ = [b["task_id"] for a, b in zip(rows[first], results, strict=True) if a["passed"] != b["passed"]]
        print(f"  {precision:6} pass@1 {passed}/{len(results)} ({passed / len(results):.3f}), auto "
              f"{tokens / seconds:.1f} tok/s, outputs identical to {first}'s: {same}/{len(results)}"
              + (f", verdicts differ on {', '.join(differ)}" if differ else ""))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
