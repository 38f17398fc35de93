"""Held-out top-1 agreement per depth of one or more heads on a train-head feature cache's
held-out set, its library windows and its target continuations apart (with
`--continuation-sequences`, train-head holds out as many continuations as windows, windows first,
less those that stopped early; the file's header says how many windows):

    python benchmarks/cpu/head_heldout.py --target $M/qwen2.5-coder-1.5b --dtype bfloat16 --inexact \\
        --heldout /work/runs/head-qwen15-cont/features/*/heldout.safetensors --heads OLD NEW

A head is a saved folder, or a run's checkpoint (RUN/checkpoint.pt) to score it before it ends.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors import safe_open

from specdec import load
from specdec.drafting import load_head
from specdec.machine import has_fast_bfloat16
from specdec.training.head_data import HeadFeatures
from specdec.training.head_train import head_from_checkpoint, target_output_rows
from specdec.training.head_trainer import evaluate


def heldout_agreement(target, head_path: str, heldout_path: str, depths: int = 4,
                      rows: torch.Tensor | None = None) -> dict[str, list[float]]:
    """The head's top-1 agreement by depth on the held-out set's windows and continuations apart
    (rows: target_output_rows(target), where the caller has them)."""
    held = HeadFeatures.load(Path(heldout_path))
    with safe_open(heldout_path, framework="pt") as handle:  # the count of windows, where train-head wrote it
        windows = int((handle.metadata() or {}).get("windows", len(held) // 2))
    halves = {"library": held.select(slice(0, windows)), "continuations": held.select(slice(windows, None))}
    rows = target_output_rows(target) if rows is None else rows  # [vocab, hidden]
    head = (head_from_checkpoint(target, head_path) if head_path.endswith(".pt")
            else load_head(head_path, target).float())
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=has_fast_bfloat16()):
        return {name: [round(a, 4) for a in evaluate(head, part, rows[head.draft_token_ids.cpu()], depths).agreement]
                for name, part in halves.items() if len(part)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--quantize", default="none")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--inexact", action="store_true")
    parser.add_argument("--heldout", required=True, help="a heldout.safetensors of train-head's feature cache")
    parser.add_argument("--heads", nargs="+", required=True, help="saved head folders or runs' checkpoint.pt files")
    parser.add_argument("--depths", type=int, default=4)
    args = parser.parse_args()
    target = load(args.target, dtype=args.dtype, exact=not args.inexact,
                  quantize=None if args.quantize == "none" else args.quantize)
    rows = target_output_rows(target)
    for path in args.heads:
        scores = heldout_agreement(target, path, args.heldout, args.depths, rows)
        print(json.dumps({"head": path, **scores}), flush=True)


if __name__ == "__main__":
    main()
