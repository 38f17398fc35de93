"""Command-line options shared by the commands, turned into the library's objects: the sampling
options into SamplingParams (with the acceptance the command's SpeculationConfig carries), the
--acceptance option. Here, not in core: the library below the commands knows no argparse."""

from __future__ import annotations

import argparse
from typing import Any

from specdec.core.acceptance import EXACT, LOSSY_PRESET, SYNTAX, canonical_acceptance
from specdec.core.sampling import SamplingParams


def sampling_from_args(args: object, **fields: Any) -> SamplingParams:
    """SamplingParams from a command line's sampling options (add_sampling_options in cli.py);
    ``fields`` adds or overrides the rest (max_new_tokens, stop)."""
    from specdec.constraint import constraint_from_args

    names = ("temperature", "top_k", "top_p", "min_p", "seed", "sampling_rule")
    values: dict[str, Any] = {name: getattr(args, name) for name in names}
    # The acceptance is the SpeculationConfig's where the command has one (it carries --acceptance).
    config = getattr(args, "speculation_config", None)
    values["acceptance"] = config.acceptance if config is not None else getattr(args, "acceptance", EXACT)
    return SamplingParams(**values, constraint=constraint_from_args(args), **fields)


def acceptance_argument(text: str) -> str:
    """--acceptance's type: the canonical spelling, or argparse's one-line error before anything loads."""
    try:
        return canonical_acceptance(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_acceptance_option(parser: Any, default_for: str = "") -> None:  # parser: an argparse parser or group
    parser.add_argument(
        "--acceptance", default=EXACT, type=acceptance_argument, metavar="exact|lossy|SCHEME[:PARAMS]",
        help=f"LOSSY opt-in: keep drafts the target finds plausible though exact verification rejects them ({SYNTAX}; "
        f"lossy = {LOSSY_PRESET}; docs/acceptance.md){default_for}; default: exact (lossless)")
