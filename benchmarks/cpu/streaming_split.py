"""Where a one-token forward's time goes against what this machine reads: in one process, rounds
interleaving (a) the read bandwidth probe (roofline_probe.cpp, 1 GiB), (b) every packed linear of
the model alone with one row (the weights a token streams), (c) T(1), the whole forward after 64
cached tokens. The medians: the linears' own read rate beside the probe's, and what the forward
adds to them. Why interleaved: a shared VM's bandwidth drifts by a third within minutes.

    python benchmarks/cpu/streaming_split.py MODEL_DIR [--quantize int4] [--rounds 15]
        [--out runs/streaming_split.json]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--quantize", default="int4", choices=["int4", "w8a32"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default="runs/streaming_split.json")
    args = parser.parse_args()
    model = load(args.model, quantize=args.quantize)
    linears = [module for module in model.network.modules() if isinstance(module, PackedLinear)]
    rows = [torch.randn(1, linear.in_features) for linear in linears]
    weight_bytes = sum(linear.records.numel() for linear in linears)
    handle, cache = probe(), prefilled_cache(model)

    def all_linears() -> float:
        return time_linears(linears, rows)

    for _ in range(3):  # warm-up
        all_linears()
        time_block(model, cache, 1, 2)
    read_gbs, linear_ms, forward_ms = [], [], []
    for _ in range(args.rounds):
        read_gbs.append(handle.specdec_probe_read_gbs(1 << 30, 2))
        linear_ms.append(all_linears() * 1e3)
        forward_ms.append(time_block(model, cache, 1, 3) * 1e3)
    gbs, linear, forward = (statistics.median(values) for values in (read_gbs, linear_ms, forward_ms))
    print(f"{len(linears)} packed linears, {weight_bytes / 1e9:.3f} GB: alone {linear:.2f} ms "
          f"({weight_bytes / linear / 1e6:.1f} GB/s); T(1) {forward:.2f} ms "
          f"(the forward adds {forward - linear:.2f} ms); "
          f"probe {gbs:.1f} GB/s (the linears read at {weight_bytes / linear / 1e6 / gbs:.2f} of it)")
    path = write_measurement(args.out, {"model": args.model, "quantize": args.quantize, "weight_bytes": weight_bytes,
                                        "read_gbs": read_gbs, "linear_ms": linear_ms, "forward_ms": forward_ms})
    print(f"-> {path}")


if __name__ == "__main__":
    main()
