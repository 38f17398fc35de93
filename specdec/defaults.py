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
    """Held-out code-completion prompts the bundled pair was measured on."""
    return DEFAULT_PAIR / "heldout_prompts.json"
