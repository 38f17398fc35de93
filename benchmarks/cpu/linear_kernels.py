"""One linear of each Qwen2.5-Coder-1.5B shape, every way torch can run it on this CPU: the int8
kernels the self-check passes (specdec/models/int8_kernels.py), float32 F.linear, and the
weight-only `torch._weight_int8pack_mm`; median ms for 1 and 5 rows, and the per-token sum
(28 layers + the LM head). Usage: python benchmarks/cpu/linear_kernels.py [--out FILE]"""
import argparse
import statistics
import time

import torch

from specdec.machine import write_measurement
from specdec.models import int8_kernels

SHAPES = {(2048, 1536): 28, (1536, 1536): 28, (17920, 1536): 28, (1536, 8960): 28, (151936, 1536): 1}


def median_ms(call, repeats: int = 10) -> float:
    call()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="runs/linear_kernels.json")
    args = parser.parse_args()
    exact = [k for k in int8_kernels.CANDIDATES if int8_kernels.check_kernel(k, 1536, 1536) is None]
    result: dict[str, dict] = {}
    for (out, inn), count in SHAPES.items():
        weight_int8 = torch.randint(-127, 128, (out, inn), dtype=torch.int8)
        weight = torch.randn(out, inn)
        scales = torch.rand(out)
        # Each call bound to this shape's tensors (default arguments), not to the loop's last ones.
        ways = {"float32 F.linear": lambda x, weight=weight: torch.nn.functional.linear(x, weight),
                "_weight_int8pack_mm": lambda x, weight_int8=weight_int8, scales=scales: torch._weight_int8pack_mm(
                    x, weight_int8, scales)}
        for kernel in exact:
            stored = kernel.prepare(weight_int8)
            ways[kernel.name] = lambda x, kernel=kernel, stored=stored: kernel.matmul(
                x.clamp(-kernel.activation_max, kernel.activation_max).round(), stored)
        for rows in (1, 5):
            x = torch.randn(rows, inn) * 20
            for name, call in ways.items():
                ms = median_ms(lambda call=call, x=x: call(x))
                entry = result.setdefault(name, {}).setdefault(f"{rows} rows", {"per shape": {}, "per token": 0.0})
                entry["per shape"][f"{out}x{inn}"] = round(ms, 3)
                entry["per token"] = round(entry["per token"] + ms * count, 1)
    for name, by_rows in result.items():
        print(
            f"{name:22s} "
            + "  ".join(
                f"{rows}: {v['per token']:7.1f} ms/token (17920x1536 {v['per shape']['17920x1536']:.2f} ms)"
                for rows, v in by_rows.items()
            )
        )
    write_measurement(args.out, {"ms": result})


if __name__ == "__main__":
    main()
