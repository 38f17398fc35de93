"""What the trees' diagnostic scripts share: the real pair's command-line options, loading it, and
the prompt they generate from (cost_diag.py, draft_cost_diag.py; run as scripts, so imported by name)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from specdec import load

PROMPT = (
    "Write a Python function that parses a CSV file and returns a list of dicts, with type hints and a docstring.\n"
)


def pair_parser(description: str, max_new_tokens: int) -> argparse.ArgumentParser:
    """MODELS_DIR, --target, --draft, --quantize and --max-new-tokens."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("models", nargs="?", default="/work/models", help="the folder holding the real pair")
    parser.add_argument("--target", help="the target's folder (default: MODELS/qwen2.5-coder-1.5b)")
    parser.add_argument("--draft", help="the draft's folder (default: MODELS/qwen2.5-coder-0.5b)")
    parser.add_argument("--quantize", default="int8", type=lambda name: None if name == "none" else name,
                        help="both models' precision (none: their float dtype)")
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    return parser


def load_pair(args: argparse.Namespace) -> tuple:
    """(target, draft) as the options name them, on 2 threads."""
    torch.set_num_threads(2)
    target = load(args.target or Path(args.models) / "qwen2.5-coder-1.5b", quantize=args.quantize)
    draft = load(args.draft or Path(args.models) / "qwen2.5-coder-0.5b", quantize=args.quantize)
    return target, draft
