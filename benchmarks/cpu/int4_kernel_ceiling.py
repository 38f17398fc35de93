"""The int4 kernel's arithmetic ceiling on this CPU: its multiply-add rate when its records never
leave the caches, beside the 8-bit dot instruction's peak (roofline_probe.cpp) and beside the
rate the same kernel reaches streaming a model's worth of records from memory.

The cached matrix (the down projection's shape, 8 MB of records) is read again and again from the
last-level cache, so its rate is what the kernel's instructions allow, whatever the memory does:
where it is itself below a fraction of the peak, no prefetching or tiling of the memory side lifts
a verify block past that fraction. (A matrix small enough for L2 measured the same rates but
scattered: its calls are short, ~0.1 ms, so the per-call quantization and thread start weigh.)
``--source FILE.cpp`` measures a variant of int4_matmul.cpp instead (a cost probe: an instruction
replaced, say), built with the same flags.

    python benchmarks/cpu/int4_kernel_ceiling.py [--rows 1,4,8,16] [--source FILE.cpp]
        [--out runs/int4_kernel_ceiling.json]
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from int4_kernel_ab import SHAPES, build  # (this folder: the script's own path comes first)
from roofline import probe

from specdec.bench.suite import machine_description
from specdec.machine import write_measurement
from specdec.models import int4, native
from specdec.models.huge_pages import into_huge_pages

CACHED = (1536, 8960)  # [out, in]: 8 MB of records, within the last-level cache of the CPUs met (8-32 MB)
STREAMED_LAYERS = 4  # the 1.5B's linears, 4 layers: 116 MB of records, far past a 2-core VM's L3


def rate(kernel, weights: list[tuple[torch.Tensor, int, int]], rows: int, seconds: float) -> float:
    """G multiply-adds a second over the weights, the median of 5 timed passes of ~seconds / 5 each."""
    inputs = [torch.randn(rows, k) for _, _, k in weights]
    outputs = [torch.empty(rows, n) for _, n, _ in weights]
    macs = rows * sum(n * k for _, n, k in weights)

    def one_pass() -> None:
        for (records, n, k), x, y in zip(weights, inputs, outputs, strict=True):
            kernel.specdec_int4_linear(x.data_ptr(), records.data_ptr(), y.data_ptr(), rows, n, k)

    one_pass()
    start = time.perf_counter()
    one_pass()
    repeats = max(1, int(seconds / 5 / max(time.perf_counter() - start, 1e-6)))
    rates = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            one_pass()
        rates.append(macs * repeats / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,8,16", help="block sizes (rows of activations)")
    parser.add_argument("--source", help="a variant of int4_matmul.cpp to measure instead of the tree's")
    parser.add_argument("--seconds", type=float, default=2.0, help="time per measurement")
    parser.add_argument("--out", default="runs/int4_kernel_ceiling.json")
    args = parser.parse_args()
    peak = probe().specdec_probe_dot_gmacs(300_000_000 // max(torch.get_num_threads(), 1), 3)
    with tempfile.TemporaryDirectory() as folder:
        source = Path(args.source) if args.source else native.KERNELS / "int4_matmul.cpp"
        if args.source:  # the headers it includes, beside it
            for header in native.KERNELS.glob("*.h"):
                (Path(folder) / header.name).write_bytes(header.read_bytes())
            (Path(folder) / "variant.cpp").write_bytes(source.read_bytes())
            source = Path(folder) / "variant.cpp"
        kernel = build(source, Path(folder), "kernel")
        torch.manual_seed(0)
        cached = [(int4.pack_weight(torch.randn(*CACHED) * 0.02).records, *CACHED)]
        shapes = [shape for shape in SHAPES for _ in range(STREAMED_LAYERS)]
        records = into_huge_pages([int4.pack_weight(torch.randn(n, k) * 0.02).records for n, k in shapes])
        streamed = [(record, n, k) for record, (n, k) in zip(records, shapes, strict=True)]
        print(f"{machine_description()}; {torch.get_num_threads()} threads; dot peak {peak:.0f} G multiply-adds/s")
        table = []
        for rows in [int(r) for r in args.rows.split(",")]:
            in_cache = rate(kernel, cached, rows, args.seconds)
            from_memory = rate(kernel, streamed, rows, args.seconds)
            table.append({"rows": rows, "cached_gmacs": round(in_cache, 1), "streamed_gmacs": round(from_memory, 1),
                          "cached_of_peak": round(in_cache / peak, 3),
                          "streamed_of_peak": round(from_memory / peak, 3)})
            print(f"{rows:>3} rows: cached {in_cache:6.1f} G/s ({in_cache / peak:.2f} of the peak), "
                  f"streamed {from_memory:6.1f} G/s ({from_memory / peak:.2f})")
    measured = {"source": str(args.source or "tree"), "peak_gmacs": peak, "threads": torch.get_num_threads(),
                "machine": machine_description(), "flags": native.compiler_flags(), "rows": table}
    print(f"-> {write_measurement(args.out, measured)}")


if __name__ == "__main__":
    main()
