"""Memory and speed of prefilling a long prompt with the default pair's target, or ``--target``
(as `specdec serve` and `specdec generate` run it), one fresh process per prompt length so that
each peak is its own.

    PYTHONPATH=. python benchmarks/prefill_memory.py --lengths 1024 4096 8000 [--chunk 16] \
        [--target DIR|FILE.gguf --quantize int4] [--out FILE.json]

For each length: resident memory (RSS) after loading the model, the peak during the prefill
(Linux's VmHWM, reset after loading), RSS after the prefill, the KV cache's own
bytes (one row, the prompt's length), and prompt tokens per second. ``--chunk 16`` is the server's
piecewise prefill (its default --prefill-chunk); ``--chunk 0`` one forward for the whole prompt
(`specdec generate`'s). Linear memory shows as a peak minus the model that grows by the KV cache's
bytes per token times the length, not by its square.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import time


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def reset_peak() -> None:
    """Linux: the high-water mark (VmHWM) starts again from the current RSS (not the load's peak)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def peak_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def prompt_ids(tokenizer, length: int) -> list[int]:
    """``length`` tokens of real text: the bundled prompts, repeated."""
    from specdec.defaults import default_prompts

    text = "\n".join(item["prompt"] for item in json.loads(default_prompts().read_text()))
    ids: list[int] = []
    while len(ids) < length:
        ids += tokenizer.encode(text)
    return ids[:length]


def measure(length: int, chunk: int | None, model: str | None, quantize: str | None, queue) -> None:
    import torch

    from specdec.assembly import engine_of
    from specdec.core.sampling import SamplingParams
    from specdec.defaults import default_pair, fastest_default_target
    from specdec.models.loading import load

    torch.set_num_threads(torch.get_num_threads())
    if model is None:
        model, quantize, _ = fastest_default_target(default_pair(), llama_cpp=False)
    target = load(model, quantize=quantize)
    engine = engine_of(target, None, prefill_chunk=chunk)
    ids = prompt_ids(target.tokenizer, length)
    loaded = rss_bytes()
    reset_peak()
    cache = target.new_cache(rows=1)
    request = engine.new_request(ids, SamplingParams(max_new_tokens=1), row=0)
    started = time.perf_counter()
    engine.prefill([request], cache)
    seconds = time.perf_counter() - started
    peak = peak_bytes()
    queue.put({"model": model, "prompt_tokens": length, "chunk": chunk, "quantize": quantize, "rss_loaded": loaded,
               "rss_peak": peak, "rss_after": rss_bytes(), "kv_cache_bytes": cache.nbytes,
               "kv_bytes_per_token": cache.bytes_per_token, "prefill_seconds": seconds,
               "prefill_tokens_per_second": (length - 1) / seconds})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8000],
                        help="prompt tokens, each below the model's context (8192 for the default target)")
    parser.add_argument("--chunk", type=int, default=16, help="prefill piece (0: the whole prompt in one forward)")
    parser.add_argument("--target", help="a model folder or GGUF (default: the default pair's target, as served)")
    parser.add_argument("--quantize", help="with --target: int4, int8, w8a32 (default: as loaded)")
    parser.add_argument("--out")
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    rows = []
    print("| prompt tokens | prefill | RSS loaded | peak | after | KV cache | peak - loaded | tokens/s |")
    print("|---|---|---|---|---|---|---|---|")
    for length in args.lengths:
        queue = context.Queue()
        process = context.Process(target=measure, args=(length, args.chunk or None, args.target, args.quantize, queue))
        process.start()
        while process.is_alive() and queue.empty():  # a child that fails says so on stderr, and puts nothing
            process.join(1)
        if queue.empty():
            raise SystemExit(f"the measurement of {length} tokens failed (exit code {process.exitcode})")
        row = queue.get()
        process.join()
        rows.append(row)
        mib = lambda count: f"{count / 2**20:.0f} MiB"  # noqa: E731
        print(f"| {length} | {'pieces of ' + str(args.chunk) if args.chunk else 'one forward'} | "
              f"{mib(row['rss_loaded'])} | {mib(row['rss_peak'])} | {mib(row['rss_after'])} | "
              f"{mib(row['kv_cache_bytes'])} | {mib(row['rss_peak'] - row['rss_loaded'])} | "
              f"{row['prefill_tokens_per_second']:.1f} |", flush=True)
    if args.out:
        with open(args.out, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
