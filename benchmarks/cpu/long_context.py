"""T(k) after long contexts: what a verify block costs when the cache, not the weights, is most
of what a step reads. The cache is filled with random keys and values up to each context length
(no prefill: only the attention's reads and arithmetic differ from a real context's), then T(k)
is timed (median of --repeats) for each block size, in each configuration: a compiled layer
library (built as kernel_library_ab.py says; "package": the installed one), the cache's dtype and
layout (":paged": a PagedKVCache whose row's blocks alternate with another row's in the pool, as
on a busy server; else one contiguous row), swapped into the loaded model in turn, interleaved
over --rounds, in one process. Prints, per
context, the bytes of cache a k-token block must read once (context x bytes a token) beside T(k);
writes JSON. A library from before the 16-bit cache reads float32 only.

    python benchmarks/cpu/long_context.py MODEL_DIR [--quantize int4] [--contexts 64,2048,4096,8192,16384]
        [--blocks 1,4,8,16] [--configs old.so:float32,package:float16,package:float16:paged] [--rounds 3]
        [--repeats 3] [--out FILE.json]
"""

import argparse
import ctypes
import statistics

import torch

from specdec.bench.suite import machine_description
from specdec.machine import write_measurement
from specdec.models import native
from specdec.models.loading import load
from specdec.models.paged_cache import BLOCK_SIZE
from specdec.models.timing import time_block


def library(path: str) -> ctypes.CDLL:
    return native.declare(ctypes.CDLL(path))  # (an older library may lack a newer call: a draft head's)


def filled_cache(model, context: int, length: int, paged: bool):
    """Row 0 holding ``context`` random keys and values (room for ``length``); paged, its blocks
    alternate with row 1's in the pool."""
    if paged:
        cache = model.network.new_paged_cache(2, 2 * (length + BLOCK_SIZE), length)
        for end in range(cache.block_size, length + cache.block_size, cache.block_size):
            cache.ensure(0, min(end, length))
            cache.ensure(1, min(end, length))
    else:
        cache = model.new_cache(rows=1, max_length=length)
        cache.reserve(length)
    generator = torch.Generator().manual_seed(0)
    shape = (model.network.config.num_kv_heads, context, model.network.config.head_dim)
    for layer in range(model.network.config.num_layers):
        cache.write(layer, 0, torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
    cache.commit(0, context)
    return cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--quantize", default="int4")
    parser.add_argument("--contexts", default="64,2048,4096,8192,16384")
    parser.add_argument("--blocks", default="1,4,8,16")
    parser.add_argument("--configs", default="package:float32,package:bfloat16",
                        help="LIBRARY:KV_DTYPE[:paged], comma-separated (LIBRARY: a .so path or package)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="runs/long_context.json")
    args = parser.parse_args()
    contexts, blocks = [int(c) for c in args.contexts.split(",")], [int(k) for k in args.blocks.split(",")]
    model = load(args.model, quantize=args.quantize)
    configs = {}
    for config in args.configs.split(","):
        paged = config.endswith(":paged")
        path, _, kv_dtype = config.removesuffix(":paged").rpartition(":")
        configs[config] = (native.library() if path == "package" else library(path), getattr(torch, kv_dtype),
                           paged)
    rows = []
    print(f"{machine_description()}; {model.name}, {model.precision}")
    print(f"{'context':>7} {'k':>3} " + " ".join(f"{name[-26:]:>26} {'MB once':>8}" for name in configs))
    for context in contexts:
        caches = {}
        for name, (_, kv_dtype, paged) in configs.items():
            model.network.kv_dtype = kv_dtype
            caches[name] = filled_cache(model, context, context + max(blocks), paged)
        times: dict[tuple[str, int], list[float]] = {(name, k): [] for name in configs for k in blocks}
        for _ in range(args.rounds):
            for name, (handle, _, _) in configs.items():
                native.library = lambda handle=handle: handle  # every compiled call reads it
                time_block(model, caches[name], 1, 1)
                for k in blocks:
                    times[(name, k)].append(time_block(model, caches[name], k, args.repeats) * 1e3)
        for k in blocks:
            measured = {name: {"ms": statistics.median(times[(name, k)]),
                               "cache_mb_once": context * caches[name].bytes_per_token / 1e6} for name in configs}
            rows.append({"context": context, "k": k, "configs": measured})
            print(f"{context:7d} {k:3d} " + " ".join(f"{m['ms']:23.1f} ms {m['cache_mb_once']:8.1f}"
                                                     for m in measured.values()), flush=True)
        del caches
    path = write_measurement(args.out, {"machine": machine_description(), "model": args.model,
                                        "precision": model.precision, "rows": rows})
    print(f"-> {path}")


if __name__ == "__main__":
    main()
