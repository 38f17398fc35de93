"""Where specdec keeps what it computes once per machine (converted models, kernel checks)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def cache_root() -> Path:
    """``$SPECDEC_CACHE``, else ``$XDG_CACHE_HOME/specdec``, else ``~/.cache/specdec``."""
    if os.environ.get("SPECDEC_CACHE"):
        return Path(os.environ["SPECDEC_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdec"


def read_json_cache(path: Path) -> dict:
    """A cache file's contents, or {} if it is missing or unreadable (then it is measured again)."""
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


def write_json_cache(path: Path, contents: dict) -> None:
    """Replace the file atomically (concurrent readers see the old file or the new one); a
    read-only cache folder only costs a new measurement next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(contents, indent=1))
        partial.replace(path)
    except OSError:
        pass
