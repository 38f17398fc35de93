"""Where specdec keeps what it computes once per machine (converted models, kernel checks)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$SPECDEC_CACHE``, else ``$XDG_CACHE_HOME/specdec``, else ``~/.cache/specdec``."""
    if os.environ.get("SPECDEC_CACHE"):
        return Path(os.environ["SPECDEC_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdec"
