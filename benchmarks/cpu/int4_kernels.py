"""Why specdec's own int4 kernel: the linears of one Qwen2.5-Coder-1.5B step (its 5 weight shapes,
random weights, each timed alone and weighted by how often a step runs it: cache-warm, so below
a real step) for 1, 5 and 8 rows, on oneDNN int8 (Int8Linear), torch's weight-only int4
(`_weight_int4pack_mm_for_cpu`, groups of 32, bf16 activations) and specdec's int4 (Int4Linear).

    python benchmarks/cpu/int4_kernels.py [--out FILE.json]
"""

import argparse
import time

import torch
from torch import nn

from specdec.bench.suite import machine_description
from specdec.machine import write_measurement
from specdec.models.int4 import Int4Linear
from specdec.models.quantize import Int8Linear

SHAPES = {"q/o": (1536, 1536), "k/v": (256, 1536), "gate/up": (8960, 1536), "down": (1536, 8960),
          "head": (151936, 1536)}
PER_STEP = {"q/o": 56, "k/v": 56, "gate/up": 56, "down": 28, "head": 1}  # 28 layers
ROWS = (1, 5, 8)


def torch_int4(linear: nn.Linear, group: int = 32):
    weight = linear.weight.detach().float()
    out_features, in_features = weight.shape
    grouped = weight.reshape(out_features, in_features // group, group)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-8)
    q = torch.round((grouped - low[..., None]) / scale[..., None]).clamp(0, 15)
    packed = torch._convert_weight_to_int4pack_for_cpu(q.reshape(out_features, in_features).to(torch.int32), 1)
    scales_and_zeros = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return lambda x: torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, group, scales_and_zeros).float()


def milliseconds(function, argument, repeats: int = 20) -> float:
    function(argument)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function(argument)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/int4_kernels.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    per_step: dict[str, dict[int, float]] = {}
    for name, (out_features, in_features) in SHAPES.items():
        linear = nn.Linear(in_features, out_features, bias=False)
        nn.init.normal_(linear.weight, std=0.02)
        kernels = {"int8 (oneDNN)": Int8Linear.of(linear), "torch int4": torch_int4(linear),
                   "specdec int4": Int4Linear.of(linear)}
        for rows in ROWS:
            x = torch.randn(rows, in_features)
            for kernel, function in kernels.items():
                step = per_step.setdefault(kernel, {})
                step[rows] = step.get(rows, 0.0) + milliseconds(function, x) * PER_STEP[name]
    for kernel, step in per_step.items():
        print(f"{kernel:14s} " + "  ".join(f"{rows} rows {ms:6.1f} ms" for rows, ms in step.items())
              + f"  ({step[5] / step[1]:.2f}x from 1 to 5 rows)")
    write_measurement(args.out, {"machine": machine_description(), "ms_per_step_linears": per_step})
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
