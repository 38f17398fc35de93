"""The bundled default pair: a target and a distilled draft trained on Python source code."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).parent / "assets"
DEFAULT_PAIR = ASSETS / "default"


def default_model(role: str) -> Path:
    """Folder of the bundled "target" or "draft"."""
    folder = DEFAULT_PAIR / role
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"the bundled {role} model is missing from {folder}; pass --target/--draft folders")
    return folder


def default_prompts() -> Path:
    """The benchmark prompt suite written for `specdec bench`: code completion, code editing
    (the prompt holds code to rewrite), docstrings and comments, structured/repetitive text;
    16 prompts each."""
    return ASSETS / "bench_prompts.json"


def heldout_prompts() -> Path:
    """Code-completion prompts cut from files the bundled pair never trained on."""
    return DEFAULT_PAIR / "heldout_prompts.json"
