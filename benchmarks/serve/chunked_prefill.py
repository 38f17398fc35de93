"""A long prompt arriving while streams run, with and without chunked prefill (the scheduler, no
HTTP): ``--streams`` requests decode, then a ``--long``-token prompt (standard-library source)
joins; per setting, the running streams' longest and median gap between two tokens while it
prefills, over their median gap before it joined, the long request's time to first token, and the
streams' tokens per second. Speculation off, so a gap is a decode step plus what the scheduler fed
before it.

    python benchmarks/serve/chunked_prefill.py [--target DIR|FILE.gguf] [--quantize Q]
        [--chunks none 16 64] [--streams 8] [--long 2048] [--out runs/chunked_prefill.json]
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import statistics
import threading
import time
from pathlib import Path

from specdec import SamplingParams, load
from specdec.assembly import engine_of
from specdec.bench.suite import machine_description
from specdec.serving.scheduler import Scheduler
from specdec.serving.speculation import SpeculationController


def long_prompt(tokenizer, length: int) -> list[int]:
    text = inspect.getsource(json.decoder) + inspect.getsource(statistics) + inspect.getsource(argparse)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < length:
        raise SystemExit(f"the source text gives {len(ids)} tokens, fewer than --long {length}")
    return ids[:length]


def run(target, chunk: int | None, prompts: list[list[int]], long_ids: list[int], new_tokens: int) -> dict:
    scheduler = Scheduler(engine_of(target, prefill_chunk=chunk), SpeculationController("off", 0),
                          max_batch=len(prompts) + 1).start()
    times: dict[int, list[float]] = {index: [] for index in range(len(prompts) + 1)}
    finished = threading.Semaphore(0)

    def emit_to(index: int):
        def emit(chunk_or_error) -> None:
            if isinstance(chunk_or_error, BaseException):
                raise chunk_or_error
            times[index].extend([time.perf_counter()] * max(1, len(chunk_or_error.token_ids)))
            if chunk_or_error.result is not None:
                finished.release()
        return emit

    try:
        for index, prompt in enumerate(prompts):
            scheduler.submit(prompt, SamplingParams(max_new_tokens=new_tokens), emit_to(index))
        while min(len(times[index]) for index in range(len(prompts))) < 24:  # every stream decoding
            time.sleep(0.005)
        joined = time.perf_counter()
        scheduler.submit(long_ids, SamplingParams(max_new_tokens=16), emit_to(len(prompts)))
        for _ in range(len(prompts) + 1):
            finished.acquire()
    finally:
        scheduler.stop()
    first_token = times[len(prompts)][0]
    worst, typical, tokens = [], [], 0
    for index in range(len(prompts)):
        pairs = [(a, b) for a, b in itertools.pairwise(times[index]) if b > a]  # one gap a step
        steady = statistics.median([b - a for a, b in pairs if b < joined])  # before the long prompt
        during = [b - a for a, b in pairs if joined < b <= first_token + 1e-9]
        worst.append(max(during, default=0.0) / steady)
        typical.append(statistics.median(during) / steady if during else 0.0)
        tokens += len(times[index])
    streams = range(len(prompts))
    span = max(times[index][-1] for index in streams) - min(times[index][0] for index in streams)
    return {"prefill_chunk": chunk, "long_ttft_s": round(first_token - joined, 3),
            "worst_gap_over_steady": round(max(worst), 2),  # the steady gap: the median before it joined
            "median_gap_during_over_steady": round(statistics.median(typical), 2),
            "streams_tokens_per_s": round(tokens / span, 2),
            "prefill_pieces_beside_streams": sum(1 for _, running in scheduler.prefill_chunks if running)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="default: the default pair's target")
    parser.add_argument("--quantize")
    parser.add_argument("--chunks", nargs="+", default=["none", "16", "64"])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--long", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--out", default="runs/chunked_prefill.json")
    args = parser.parse_args()
    if args.target is None:
        from specdec.defaults import default_pair, fastest_default_target

        path, quantize, line = fastest_default_target(default_pair())
        print(line)
        target = load(path, quantize=quantize)
    else:
        target = load(args.target, quantize=args.quantize)
    suite = json.loads((Path(__file__).resolve().parents[2] / "specdec/assets/bench_prompts.json").read_text())
    prompts = [target.tokenizer(item["prompt"])["input_ids"] for item in suite[: args.streams]]
    long_ids = long_prompt(target.tokenizer, args.long)
    rows = []
    for chunk in args.chunks:
        row = run(target, None if chunk == "none" else int(chunk), prompts, long_ids, args.new_tokens)
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine_description(), "date": time.strftime("%Y-%m-%dT%H:%M"),
                                          "target": args.target or "default", "streams": args.streams,
                                          "long": args.long, "rows": rows}, indent=1))
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
