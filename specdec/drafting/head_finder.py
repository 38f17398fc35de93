"""Draft heads found for a target by themselves, matched by the target's identity.

A head is trained for one target: it reads that target's hidden states and shares its embedding.
Shapes alone do not say which target (two fine-tunes of one base have the same shapes), so a head
folder records its target in ``target.json``: the model type, hidden size, layer count, vocabulary
size, and a probe of the embedding the head reads (a few of its entries at fixed places). A head
is used for a target only when all of these agree (the probe within the rounding of bfloat16 and
of 4- or 8-bit GGUF blocks, so one model's folder and its GGUF both match); a head without the
record is used only when named (``--draft-head DIR``).

Where heads are looked for, in order: the heads that ship with the package (``specdec/assets``),
the repository's ``heads/`` folder beside it, the cache (``$SPECDEC_CACHE/heads``, where
``specdec train-head`` writes by default) and the folders in ``$SPECDEC_HEADS`` (``os.pathsep``
separated; each a head, a folder of heads, or a ``train-head --out`` folder: in every place a
head is looked for in the place, its subfolders and their ``head`` folder).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdec.machine import cache_root
from specdec.models.base import LanguageModel

ARCHITECTURE = "LlamaForCausalLMEagle3"  # what an EAGLE-3 head's config.json names (head_format.py)
TARGET_FILE = "target.json"
PROBE_ROWS, PROBE_COLUMNS = 16, 8
# bfloat16 keeps 8 bits of mantissa; a Q4_K/Q6_K GGUF's blocks round further: both stay well inside
# this, while another model's embedding differs by its whole scale.
RELATIVE_TOLERANCE, ABSOLUTE_TOLERANCE = 0.05, 2e-3


@dataclass(frozen=True)
class TargetIdentity:
    model_type: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    probe: tuple[float, ...]  # the embedding at PROBE_ROWS token ids spread over the vocabulary, first columns

    def differs(self, other: TargetIdentity) -> str | None:
        """Why a head made for ``other`` does not fit this target (None: it fits)."""
        for name in ("model_type", "hidden_size", "num_layers", "vocab_size"):
            if getattr(self, name) != getattr(other, name):
                return f"{name} {getattr(other, name)} (the target's: {getattr(self, name)})"
        if len(self.probe) != len(other.probe) or any(
                abs(a - b) > ABSOLUTE_TOLERANCE + RELATIVE_TOLERANCE * abs(a)
                for a, b in zip(self.probe, other.probe, strict=True)):
            return "another embedding (trained for another model of the same shape)"
        return None


def target_embedding(target: LanguageModel) -> torch.Tensor:  # [vocab, hidden]
    """The target's input embedding, which the head shares (own forward or transformers adapter)."""
    network = target.network
    module = getattr(network, "embed_tokens", None)
    if module is None and hasattr(network, "model"):
        module = network.model.get_input_embeddings()
    if module is None:
        raise ValueError(f"a draft head reads the target's hidden states and embedding; the {target.backend} backend "
                         "gives neither (load the target with --backend specdec)")
    return module.weight.detach().float()


def embedding_probe(embedding: torch.Tensor) -> tuple[float, ...]:  # embedding [vocab, hidden]
    rows = torch.linspace(0, embedding.shape[0] - 1, PROBE_ROWS).long()
    return tuple(round(float(value), 6) for value in embedding[rows, :PROBE_COLUMNS].float().flatten())


def target_identity(target: LanguageModel) -> TargetIdentity | None:
    """The identity of a target on specdec's own forward (None: another backend, which gives no hidden states)."""
    config = getattr(target.network, "config", None)
    if target.backend != "specdec" or config is None or not hasattr(config, "num_layers"):
        return None
    return TargetIdentity(config.model_type, config.hidden_size, config.num_layers, target.vocab_size,
                          embedding_probe(target_embedding(target)))


def write_identity(folder: str | Path, identity: TargetIdentity) -> None:
    (Path(folder) / TARGET_FILE).write_text(json.dumps(asdict(identity)) + "\n")


def read_identity(folder: Path) -> TargetIdentity | None:
    path = folder / TARGET_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return TargetIdentity(**{**data, "probe": tuple(data["probe"])})


def head_folders() -> list[Path]:
    """Every folder that holds an EAGLE-3 head, in the order of the module docstring: a place
    itself, its subfolders, and the ``head`` folder in each (where ``specdec train-head`` saves a
    run's head: ``$SPECDEC_CACHE/heads/<target>/head`` by default)."""
    package = Path(__file__).resolve().parent.parent
    places = [package / "assets", package.parent / "heads", cache_root() / "heads"]
    places += [Path(entry) for entry in os.environ.get("SPECDEC_HEADS", "").split(os.pathsep) if entry]
    found = []
    for place in places:
        for folder in [place, *(sorted(place.iterdir()) if place.is_dir() else [])]:
            for candidate in (folder, folder / "head"):
                if (candidate / "config.json").is_file() and (candidate / "model.safetensors").is_file() \
                        and is_head(candidate):
                    found.append(candidate)
    return list(dict.fromkeys(found))


def is_head(folder: Path) -> bool:
    try:
        return ARCHITECTURE in json.loads((folder / "config.json").read_text()).get("architectures", [])
    except (OSError, ValueError):
        return False


def find_head(target: LanguageModel) -> Path | None:
    """The first head whose recorded target is this one (None: none found, or a backend without hidden states)."""
    identity = target_identity(target)
    if identity is None:
        return None
    for folder in head_folders():
        recorded = read_identity(folder)
        if recorded is not None and identity.differs(recorded) is None:
            return folder
    return None


def how_auto_finds(folder: Path, target: LanguageModel) -> str:
    """How a head just saved in ``folder`` for ``target`` is used: found by ``--drafter auto``, or
    behind the head that auto takes first, or in a folder auto does not look in."""
    first = find_head(target)
    if first is not None and first.resolve() == folder.resolve():
        return "--drafter auto finds it for this target"
    if first is not None:
        return f"--drafter auto takes {first} first for this target: name this one with --draft-head {folder}"
    return f"--draft-head {folder}, or add {folder.parent} to $SPECDEC_HEADS for --drafter auto to find it"


def check_fits(folder: str | Path, target: LanguageModel) -> None:
    """ValueError naming what differs when a head records another target than this one."""
    identity, recorded = target_identity(target), read_identity(Path(folder))
    if identity is not None and recorded is not None and (why := identity.differs(recorded)):
        raise ValueError(f"the draft head at {folder} was trained for another target: {why}")
