"""The CPU table of docs/design.md: for each backend and precision of one target, whether a verify
block scores each token exactly as alone (checked here, on this CPU), and T(k), the median time of
a k-token forward after a 64-token context, one configuration loaded at a time.

    python benchmarks/cpu/t_of_k.py MODEL_DIR [--gguf FILE] [--blocks 1,5,8] [--out runs/t_of_k.json]
        [--configs int8 int4 w8a32 float32-exact float32-inexact bfloat16-exact llama.cpp]
"""

import argparse
import gc

from specdec.bench.forward import prefilled_cache, time_block
from specdec.bench.suite import machine_description
from specdec.machine import write_measurement
from specdec.models import quantize
from specdec.models.backend_choice import block_is_exact
from specdec.models.loading import load

CONFIGS = {
    "int8": dict(quantize="int8"),
    "int4": dict(quantize="int4"),
    "w8a32": dict(quantize="w8a32"),
    "float32-exact": dict(),
    "float32-inexact": dict(exact=False),
    "bfloat16-exact": dict(dtype="bfloat16"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--gguf", help="the same model's GGUF file, for the llama.cpp row")
    parser.add_argument("--blocks", default="1,5,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", nargs="+", default=[*CONFIGS, "llama.cpp"])
    parser.add_argument("--out", default="runs/t_of_k.json")
    args = parser.parse_args()
    blocks = [int(b) for b in args.blocks.split(",")]
    rows = []
    for name in args.configs:
        if name == "llama.cpp":
            if not args.gguf:
                continue
            model = load(args.gguf, backend="llama.cpp")
        else:
            model = load(args.model, **CONFIGS[name])
        exact = block_is_exact(model)
        cache = prefilled_cache(model, 1, 64)
        time_block(model, cache, 1, 1)  # warm-up
        times = {k: time_block(model, cache, k, args.repeats) * 1e3 for k in blocks}
        row = {"config": name, "exact_blocks": exact, "ms": times,
               "notice": quantize.kernel_notice() if name == "int8"
               else getattr(model.network, "quantize_notice", None)}
        rows.append(row)
        print(f"{name:16s} exact={exact!s:5s} " + "  ".join(f"T({k})={ms:7.1f} ms" for k, ms in times.items())
              + f"  T({blocks[-1]})/T(1)={times[blocks[-1]] / times[blocks[0]]:.2f}", flush=True)
        del model, cache
        gc.collect()
    write_measurement(
        args.out, {"machine": machine_description(), "model": args.model, "gguf": args.gguf, "rows": rows}
    )
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
