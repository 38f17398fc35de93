"""Held-out top-1 agreement per depth of one or more heads on a train-head feature cache's
held-out set, its library windows and its target continuations apart (with
`--continuation-sequences`, train-head holds out as many continuations as windows, windows first,
less those that stopped early; the file's header says how many windows):

    python benchmarks/cpu/head_heldout.py --target $M/qwen2.5-coder-1.5b --dtype bfloat16 --inexact \\
        --heldout /work/runs/head-qwen15-cont/features/*/heldout.safetensors --heads OLD NEW
"""

from __future__ import annotations

import argparse
import json

import torch
from safetensors import safe_open

from specdec import load
from specdec.drafting import load_head
from specdec.training.head_data import HeadFeatures
from specdec.training.head_train import target_output_rows
from specdec.training.head_trainer import evaluate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--quantize", default="none")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--inexact", action="store_true")
    parser.add_argument("--heldout", required=True, help="a heldout.safetensors of train-head's feature cache")
    parser.add_argument("--heads", nargs="+", required=True)
    parser.add_argument("--depths", type=int, default=4)
    args = parser.parse_args()
    target = load(args.target, dtype=args.dtype, exact=not args.inexact,
                  quantize=None if args.quantize == "none" else args.quantize)
    held = HeadFeatures.load(args.heldout)
    with safe_open(args.heldout, framework="pt") as handle:  # the count of windows, where train-head wrote it
        windows = int((handle.metadata() or {}).get("windows", len(held) // 2))
    halves = {"library": held.select(slice(0, windows)), "continuations": held.select(slice(windows, None))}
    rows = target_output_rows(target)  # [vocab, hidden]
    for path in args.heads:
        head = load_head(path, target).float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            scores = {name: evaluate(head, part, rows[head.draft_token_ids.cpu()], args.depths).agreement
                      for name, part in halves.items()}
        rounded = {name: [round(a, 3) for a in agreement] for name, agreement in scores.items()}
        print(json.dumps({"head": path, **rounded}), flush=True)


if __name__ == "__main__":
    main()
