"""A/B of whole compiled kernel libraries on a real model: T(k) of the int4 target's full forward
(matmuls, compiled layer ops, attention) with each library swapped in turn into the loaded model,
in one process, k's and libraries interleaved over rounds, medians kept. Why one process: on a
shared VM the memory bandwidth, and so T(1), drifts between processes by up to 40%.

Build each library from a revision's sources and headers with the kernels' flags
(specdec.models.native.compiler_flags()), e.g.
    mkdir old && for f in $(git ls-tree --name-only REV specdec/models/kernels/); do
        git show REV:$f > old/$(basename $f); done
    g++ -march=native -O3 -fopenmp -ffp-contract=off -shared -fPIC old/*.cpp -o old.so
then
    python benchmarks/cpu/kernel_library_ab.py MODEL_DIR old.so,new.so 1,2,4,8,16 [ROUNDS]
(-march=x86-64-v3 and ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 for the AVX2 path.)
"""

import ctypes
import os
import statistics
import sys

from specdec.models import native
from specdec.models.loading import load
from specdec.models.timing import prefilled_cache, time_block


def main() -> None:
    model_dir, paths, blocks = sys.argv[1], sys.argv[2].split(","), [int(k) for k in sys.argv[3].split(",")]
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    handles = [native.declare(ctypes.CDLL(path)) for path in paths]
    model = load(model_dir, quantize=os.environ.get("QUANTIZE", "int4"))  # w8a32 for a GGUF-exact target
    cache = prefilled_cache(model, 1, 64)
    times: dict[tuple[str, int], list[float]] = {(path, k): [] for path in paths for k in blocks}
    for _ in range(rounds):
        for path, handle in zip(paths, handles, strict=False):
            native.library = lambda handle=handle: handle  # every compiled call reads it
            time_block(model, cache, 1, 1)
            for k in blocks:
                times[(path, k)].append(time_block(model, cache, k, 3) * 1e3)
    for path in paths:
        first = statistics.median(times[(path, blocks[0])])
        print(path, "  ".join(f"T({k})={statistics.median(times[(path, k)]):.1f}" for k in blocks),
              "  " + " ".join(f"T({k})/T({blocks[0]})={statistics.median(times[(path, k)]) / first:.2f}"
                             for k in blocks[1:]), flush=True)


if __name__ == "__main__":
    main()
