"""`specdec train-head`: an EAGLE-3 draft head for a target, trained here on the target's own
features (cached on disk), resumable from its last checkpoint, saved in the EAGLE-3 layout with a
model card that records the exact command."""

from __future__ import annotations

import argparse

from rich.console import Console

from specdec.training.head_settings import HeadTraining


def add_parser(commands, add_model_options) -> None:
    parser = commands.add_parser(
        "train-head", help="train an EAGLE-3 draft head that reads the target's hidden states",
        description="Target features (cached under --out/features) -> a draft head trained with EAGLE-3's "
                    "training-time test -> an EAGLE-3 folder (config.json, model.safetensors, README.md) "
                    "for --drafter head|head-tree --draft-head DIR. Resumes from --out/checkpoint.pt.")
    add_model_options(parser)  # the target as it will be drafted for (its precision decides its features)
    parser.add_argument("--out", help="output folder (default: $SPECDEC_CACHE/heads/<target name>, where the "
                                      "auto drafter finds the head for this target by itself)")
    parser.add_argument(
        "--data", nargs="+", default=(),
        help="files or folders of code, or 'stdlib' (Python's standard library, the default) and 'site-packages' "
             "(this environment's installed packages); a benchmark suite's files are always left out")
    parser.add_argument("--hours", type=float, help="stop after this many hours, everything done so far saved; "
                                                    "the same command goes on from there")
    defaults = HeadTraining(out="")
    for name in (
        "draft_vocab",
        "steps",
        "ttt_steps",
        "sequence_length",
        "corpus_sequences",
        "continuation_sequences",
        "continuation_start",
        "heldout_sequences",
        "batch_size",
        "eval_every",
        "checkpoint_every",
        "seed",
    ):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    for name, what in (("windows", "corpus windows"), ("continuations", "continuations")):
        parser.add_argument(f"--train-{name}", type=int, metavar="N",
                            help=f"make and train on only the first N {what} of the plan (whole saved parts, the "
                                 "ones the whole plan reads): a learning curve's points, each with its own --out")
    parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
    parser.add_argument(
        "--precision", default=defaults.precision, choices=["auto", "float32", "bfloat16"],
        help="the head's matmuls while training: bfloat16 autocast (auto: on a GPU, or a CPU with AMX or "
             "AVX-512 BF16), else float32; the saved head is bfloat16 either way",
    )
    parser.add_argument("--intermediate-size", type=int, help="the head's MLP width (default: the target's)")
    parser.add_argument("--init-head", help="an EAGLE-3 head folder to start from (its draft vocabulary and sizes), "
                                            "e.g. to go on training a head on the target's own continuations; "
                                            "a --draft-vocab larger than its vocabulary widens that with the "
                                            "data's most frequent other tokens (their output rows start at the "
                                            "mean of the head's)")


def run(args: argparse.Namespace, console: Console, errors: Console) -> int:
    import dataclasses
    import shlex

    from specdec.commands.models import load_own_target

    target = load_own_target(args, errors)
    if args.out is None:
        from specdec.machine import cache_root

        args.out = str(cache_root() / "heads" / safe_name(target.name))
        errors.print(f"[dim]training into {args.out} (a folder --drafter auto looks in)[/]",
                     highlight=False, soft_wrap=True)
    # Every setting but these two is the option of the same name.
    options = {field.name: getattr(args, field.name) for field in dataclasses.fields(HeadTraining)
               if field.name not in ("data", "command")}
    settings = HeadTraining(**options, data=tuple(args.data), command=shlex.join(["specdec", *args.argv]))
    from specdec.training.budget import BudgetSpent
    from specdec.training.head_train import train_head

    try:
        folder = train_head(target, settings, errors)
    except BudgetSpent as stopped:
        errors.print(f"stopped: {stopped}; run the same command again to go on", highlight=False, soft_wrap=True)
        return 0
    from specdec.drafting.head_finder import how_auto_finds

    errors.print(f"head saved to {folder}: {how_auto_finds(folder, target)}", highlight=False, soft_wrap=True)
    return 0


def safe_name(name: str) -> str:
    """A model's name as one folder name."""
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name.strip("/").rsplit("/", 1)[-1]) or "target"
