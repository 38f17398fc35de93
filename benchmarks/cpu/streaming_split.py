"""Where a forward's time goes against what this machine reads: in one process, rounds
interleaving (a) the read bandwidth probe (roofline_probe.cpp, 1 GiB), and for each block size k
(b) every packed linear of the model alone with k rows (the weights a token streams), (c) T(k), the
whole forward of k tokens after 64 cached tokens. The medians: the linears' own read rate beside
the probe's, and what the forward adds to them. Why interleaved: a shared VM's bandwidth drifts by
a third within minutes.

    python benchmarks/cpu/streaming_split.py MODEL_DIR [--quantize int4] [--blocks 1,8,16]
        [--rounds 15] [--out runs/streaming_split.json]
"""

import argparse
import statistics
import time

import torch
from roofline import probe  # (this folder: the script's own path comes first)

from specdec.machine import write_measurement
from specdec.models.int4 import PackedLinear
from specdec.models.loading import load
from specdec.models.timing import prefilled_cache, time_block


def time_linears(linears: list[PackedLinear], rows: list[torch.Tensor]) -> float:
    """Seconds for every packed linear once with its one row (the weights a token streams)."""
    started = time.perf_counter()
    for linear, row in zip(linears, rows, strict=True):
        linear.multiply(row)
    return time.perf_counter() - started


def split_line(weight_bytes: int, linear_ms: list[float], forward_ms: list[float], gbs: float, k: int = 1) -> str:
    """The medians of the linears alone and of T(k), the linears' read rate against the probe's."""
    linear, forward = statistics.median(linear_ms), statistics.median(forward_ms)
    return (f"linears alone {linear:.2f} ms ({weight_bytes / linear / 1e6:.1f} GB/s, "
            f"{weight_bytes / linear / 1e6 / gbs:.2f} of the probe); T({k}) {forward:.2f} ms "
            f"(the forward adds {forward - linear:.2f} ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--quantize", default="int4", choices=["int4", "w8a32"])
    parser.add_argument("--blocks", default="1", help="block sizes k (tokens a forward)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default="runs/streaming_split.json")
    args = parser.parse_args()
    model = load(args.model, quantize=args.quantize)
    linears = [module for module in model.network.modules() if isinstance(module, PackedLinear)]
    blocks = [int(k) for k in args.blocks.split(",")]
    rows = {k: [torch.randn(k, linear.in_features) for linear in linears] for k in blocks}
    weight_bytes = sum(linear.records.numel() for linear in linears)
    handle, cache = probe(), prefilled_cache(model)
    for _ in range(3):  # warm-up
        for k in blocks:
            time_linears(linears, rows[k])
            time_block(model, cache, k, 2)
    read_gbs: list[float] = []
    linear_ms: dict[int, list[float]] = {k: [] for k in blocks}
    forward_ms: dict[int, list[float]] = {k: [] for k in blocks}
    for _ in range(args.rounds):
        read_gbs.append(handle.specdec_probe_read_gbs(1 << 30, 2))
        for k in blocks:
            linear_ms[k].append(time_linears(linears, rows[k]) * 1e3)
            forward_ms[k].append(time_block(model, cache, k, 3) * 1e3)
    gbs = statistics.median(read_gbs)
    print(f"{len(linears)} packed linears, {weight_bytes / 1e9:.3f} GB; probe {gbs:.1f} GB/s")
    for k in blocks:
        print(f"k={k}: {split_line(weight_bytes, linear_ms[k], forward_ms[k], gbs, k)}")
    path = write_measurement(args.out, {"model": args.model, "quantize": args.quantize, "weight_bytes": weight_bytes,
                                        "read_gbs": read_gbs, "linear_ms": linear_ms, "forward_ms": forward_ms})
    print(f"-> {path}")


if __name__ == "__main__":
    main()
