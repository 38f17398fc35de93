"""`specdec train`: the command line of specdec/training (a pair from scratch, or a draft
distilled for an existing model with --teacher)."""

from __future__ import annotations

import argparse

from rich.console import Console


def add_shape_options(parser: argparse.ArgumentParser, name: str, hidden: int, layers: int, heads: int,
                      kv_heads: int, intermediate: int) -> None:
    parser.add_argument(f"--{name}-hidden", type=int, default=hidden)
    parser.add_argument(f"--{name}-layers", type=int, default=layers)
    parser.add_argument(f"--{name}-heads", type=int, default=heads)
    parser.add_argument(f"--{name}-kv-heads", type=int, default=kv_heads)
    parser.add_argument(f"--{name}-intermediate", type=int, default=intermediate)
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument(f"--{name}-steps", type=int, help="train for this many steps, or")
    budget.add_argument(f"--{name}-minutes", type=float, help="train for about this many minutes")
    parser.add_argument(f"--{name}-lr", type=float, default=2e-3 if name == "target" else 3e-3)


def add_parser(commands) -> None:
    train = commands.add_parser(
        "train", help="train a BPE tokenizer, a target and a distilled draft on text files",
        description="Text files -> BPE tokenizer -> Llama-style target -> draft distilled from the target "
                    "(forward KL to its soft labels). Saves Hugging Face folders under --out.",
    )
    train.add_argument("--data", nargs="+", required=True, help="files or folders of training text")
    train.add_argument("--suffix", action="append", default=None, help="file suffix to read (default .py)")
    train.add_argument("--out", required=True, help="output folder (tokenizer/, target/, draft/, checkpoints/)")
    train.add_argument("--vocab-size", type=int, default=4096)
    train.add_argument("--seq-len", type=int, default=256)
    train.add_argument("--batch-size", type=int, default=16)
    train.add_argument("--max-positions", type=int, default=2048)
    train.add_argument("--heldout-fraction", type=float, default=0.03)
    train.add_argument("--eval-every", type=int, default=200)
    train.add_argument("--checkpoint-every", type=int, default=100)
    train.add_argument("--save-dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--resume", action="store_true", help="continue from the checkpoints under --out")
    add_shape_options(train, "target", 256, 6, 4, 2, 704)
    add_shape_options(train, "draft", 128, 1, 4, 2, 384)
    train.add_argument("--teacher", help="distil a draft for this existing model folder instead (its tokenizer, "
                                         "its layers --draft-from-layers as the start; no target is trained)")
    train.add_argument("--draft-from-layers", type=lambda text: tuple(int(i) for i in text.split(",")),
                       default=(0, 1, -1), help="with --teacher: the teacher's layers the draft starts from "
                                                "(comma-separated, negative counts from the end)")
    train.add_argument("--draft-output-tokens", type=int, default=0,
                       help="with --teacher: the draft proposes only this many of the most frequent training tokens "
                            "(a cheaper output head; 0 = all)")


def run(args: argparse.Namespace, console: Console, errors: Console) -> int:
    from specdec.training.pipeline import TrainConfig, command_line, train_pair
    from specdec.training.trainer import ModelShape, TrainPlan

    def shape(name: str) -> ModelShape:
        return ModelShape(*(getattr(args, f"{name}_{field}") for field in
                            ("hidden", "layers", "heads", "kv_heads", "intermediate")))

    def plan(name: str) -> TrainPlan:
        steps, minutes = getattr(args, f"{name}_steps"), getattr(args, f"{name}_minutes")
        if steps is None and minutes is None:
            steps = 1000
        return TrainPlan(name, steps=steps, minutes=minutes, learning_rate=getattr(args, f"{name}_lr"),
                         eval_every=args.eval_every, checkpoint_every=args.checkpoint_every)

    if args.teacher:
        return run_distill(args, plan("draft"), errors)
    config = TrainConfig(
        data=args.data, out=args.out, target_shape=shape("target"), draft_shape=shape("draft"),
        target_plan=plan("target"), draft_plan=plan("draft"), vocab_size=args.vocab_size, seq_len=args.seq_len,
        batch_size=args.batch_size, max_positions=args.max_positions, heldout_fraction=args.heldout_fraction,
        seed=args.seed, save_dtype=args.save_dtype, resume=args.resume, command=command_line(),
        suffixes=tuple(args.suffix or [".py"]),
    )
    train_pair(config, errors)
    return 0


def run_distill(args: argparse.Namespace, plan, errors: Console) -> int:
    import json
    from pathlib import Path

    from specdec.training.distill import DistillConfig, distill_draft
    from specdec.training.pipeline import command_line

    config_file = Path(args.teacher) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"--teacher needs a model folder with a config.json: {config_file} not found")
    count = json.loads(config_file.read_text())["num_hidden_layers"]
    layers = tuple(index % count if -count <= index < count else index for index in args.draft_from_layers)
    distill_draft(DistillConfig(
        teacher=args.teacher, data=args.data, out=args.out, layers=layers, plan=plan, seq_len=args.seq_len,
        batch_size=args.batch_size, heldout_fraction=args.heldout_fraction, seed=args.seed,
        save_dtype=args.save_dtype, resume=args.resume, command=command_line(), suffixes=tuple(args.suffix or [".py"]),
        output_tokens=args.draft_output_tokens,
    ), errors)
    return 0
