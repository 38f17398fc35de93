"""The fastest exact precision for a user's model on this CPU, chosen once and said in one line.

A checkpoint's float32 is rarely the fastest way to run it on a CPU: a 1.5B model reads 6 GB of
weights per token in float32 and under 1 GB in int4. Which precision is fastest depends on the
instruction set (int8's oneDNN path is flattest with AMX, int4's kernel elsewhere), so nothing is
assumed: each candidate whose verify blocks are exact here (a token scored inside a block gets the
logits it gets alone) is loaded and timed on a 1- and a 5-token forward, once per machine and model
shape (backend_choice.choose_fastest_exact), and the fastest runs. The line that says so gives the
way back: ``--quantize none`` for a folder's own float32 (its text, and how much slower it was
measured), ``--quantize w8a32`` for a GGUF's weights held exactly with float32 activations.

Models under ``SMALL_MODEL_PARAMETERS`` keep float32 unmeasured: their forward is mostly overhead,
and measuring would cost more than it saves.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specdec.names import SMALL_MODEL_PARAMETERS

FOLDER_CANDIDATES = ("int4", "int8", "none")  # none: the checkpoint's own float32
GGUF_CANDIDATES = ("int4", "w8a32")  # w8a32 holds a GGUF's 4- and 8-bit weights exactly: float32's text


def parameter_estimate(path: Path) -> int | None:
    """Parameters of a Hugging Face folder from its config.json (a GGUF: its bytes, about one per
    parameter at 8 bits); None when neither says."""
    if path.suffix == ".gguf":
        return path.stat().st_size if path.is_file() else None
    try:
        config = json.loads((path / "config.json").read_text())
        hidden, layers = config["hidden_size"], config["num_hidden_layers"]
        intermediate = config.get("intermediate_size", 4 * hidden)
        return layers * (4 * hidden * hidden + 3 * hidden * intermediate) + config["vocab_size"] * hidden
    except (OSError, KeyError, ValueError, TypeError):
        return None


# Bits a weight of each GGUF tensor type holds, for the types a GGUF's matrices come in.
GGUF_TYPE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "IQ4_NL": 4, "IQ4_XS": 4, "Q3_K": 3, "Q2_K": 2, "Q5_0": 5, "Q5_1": 5,
                  "Q5_K": 5, "Q6_K": 6, "Q8_0": 8, "Q8_K": 8, "F16": 16, "BF16": 16, "F32": 32}


def gguf_four_bit_share(path: Path) -> float:
    """The share of a GGUF's matrix weights (by count) stored in 4 bits or fewer. int4 runs a
    file's 5-, 6- and 8-bit matrices re-rounded to 4 bits: another model (the Gemma 3 270M
    Q4_K_M, mostly Q5_0 and Q8_0, agreed with its own weights on 90% of greedy tokens in int4
    against 99.8% in w8a32), so int4 is a candidate only where most weights are 4-bit already."""
    import gguf

    counts = {"low": 0, "high": 0}
    try:
        tensors = gguf.GGUFReader(str(path)).tensors
    except (ValueError, OSError):
        return 1.0  # unreadable here: the candidates are measured, and loading says what is wrong
    for tensor in tensors:
        if len(tensor.shape) >= 2:
            bits = GGUF_TYPE_BITS.get(tensor.tensor_type.name, 8)
            counts["low" if bits <= 4 else "high"] += int(tensor.n_elements)
    total = counts["low"] + counts["high"]
    return counts["low"] / total if total else 0.0


def own_forward_problem(path: Path) -> str | None:
    """Why the own forward cannot run the model (its architecture, in one line), or None: the
    precisions measured are the own forward's, so a model it cannot run is not measured."""
    from transformers import AutoConfig

    from specdec.models.transformer import TransformerConfig, UnsupportedByLeanModel, rope_frequencies

    try:
        gguf = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
        hf_config = AutoConfig.from_pretrained(str(path.parent if gguf else path), **gguf)
        rope_frequencies(hf_config, TransformerConfig.from_hf(hf_config))
    except UnsupportedByLeanModel as reason:
        return f"specdec's own forward cannot run {getattr(hf_config, 'model_type', path.name)}: {reason}"
    except (ValueError, OSError, KeyError):
        return None  # load() says what is wrong with the folder or file
    return None


def worth_measuring(path: str) -> bool:
    """Whether a target is big enough that its precision is measured (else float32 stays)."""
    parameters = parameter_estimate(Path(path))
    return parameters is not None and parameters >= SMALL_MODEL_PARAMETERS


def shape_key(path: Path) -> str:
    """What the measurement is kept under besides the machine: the model's shape, not its weights."""
    if path.suffix == ".gguf":
        return f"gguf {path.stat().st_size}"
    config = json.loads((path / "config.json").read_text())
    return " ".join(f"{key}={config.get(key)}" for key in ("model_type", "hidden_size", "intermediate_size",
                                                            "num_hidden_layers", "num_attention_heads",
                                                            "num_key_value_heads", "vocab_size"))


def choose_precision(path: str, load: Callable[[str | None], object],
                     progress: Callable[[str], None] | None = None) -> tuple[str | None, str] | None:
    """(quantize for ``load``, the line that says why) for a CPU float32 target left unset by the
    user; None where the model is small (float32 stays). ``load(quantize)`` loads the target."""
    from specdec.models.backend_choice import choose_fastest_exact

    where = Path(path)
    if not worth_measuring(path):
        return None
    problem = own_forward_problem(where)
    if problem is not None:
        return None, f"precision: float32 on the transformers adapter ({problem})"
    gguf = where.suffix == ".gguf"
    if gguf and gguf_four_bit_share(where) < 0.5:
        return "w8a32", ("precision: w8a32, the GGUF's own weights (most of its matrices hold more than 4 bits, "
                         "which int4 would round away; --quantize int4 to run it so anyway)")
    names = GGUF_CANDIDATES if gguf else FOLDER_CANDIDATES
    candidates = {name: (lambda name=name: load(None if name == "none" else name)) for name in names}
    try:
        choice = choose_fastest_exact(candidates, f"precision {shape_key(where)}", progress)  # type: ignore[arg-type]
    except RuntimeError as error:  # no candidate exact here: float32, with the reasons in one line
        return None, f"precision: float32, no quantized precision ran exactly here ({error})"
    fastest = choice.milliseconds[choice.name]
    way_back = "w8a32" if gguf else "none"
    back = choice.milliseconds.get(way_back)
    what = "the GGUF's weights exactly, float32 activations" if gguf else "the checkpoint's float32 text"
    if choice.name == way_back:
        line = f"precision: {choice.name} ({what}), the fastest exact one measured here"
    else:
        slower = f", {back / fastest:.1f}x slower here" if back else f" ({choice.refused.get(way_back, 'not run')})"
        line = (f"precision: {choice.name}, the fastest with exact verify blocks on this CPU "
                f"({fastest:.0f} ms for a 1- plus a 5-token forward); --quantize {way_back} for {what}{slower}")
    others = [name for name in choice.milliseconds if name not in (choice.name, way_back)]
    if others:
        line += "; also measured: " + ", ".join(f"{name} {choice.milliseconds[name]:.0f} ms" for name in others)
    return (None if choice.name == "none" else choice.name), line + " (measured once, cached)"


def announce_precision(target: str, backend: str, trust_remote_code: bool, errors: Any) -> tuple[str | None] | None:
    """(quantize,) for the command line's --target with --quantize unset (None in it: float32),
    measured with a progress line and said in one line on ``errors`` (a rich Console); None where
    the model is small enough not to measure."""
    from specdec.models.loading import load
    from specdec.progress import waiting

    if not worth_measuring(target):
        return None

    def load_as(quantize: str | None) -> object:
        return load(target, quantize=quantize, backend=backend, trust_remote_code=trust_remote_code)

    with waiting(errors, "choosing the fastest exact precision for this model here") as update:
        choice = choose_precision(target, load_as, update)
    if choice is None:
        return None
    errors.print(f"[dim]{choice[1]}[/]", highlight=False, soft_wrap=True)
    return (choice[0],)
