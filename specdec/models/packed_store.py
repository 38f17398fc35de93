"""Packed weights on disk: the first load of a model in a precision (int4, w8a32, int8) writes
its packed parts to the cache folder as it packs them; every later load memory-maps them back, with
no float32 copy and no packing (the 1.5B's packing took ~12 s of every start before).

An entry is a folder ``$SPECDEC_CACHE/packed/<model>-<precision>-<key>/``: one safetensors file a
part (each layer, the embedding, the final norm, the head) and ``manifest.json``, which says what
each packed linear is, which layers run compiled, and each file's size and CRC-32. The key covers
the checkpoint's files (names, sizes, modification times), its config, the precision, a draft's
output tokens and the code and machine that packing depends on (packed layouts, the kernel
library's key: what ran here and passed its checks), so a changed weight file or a new specdec
version packs anew. Entries are written to a temporary folder and renamed when complete; a file
whose size or checksum differs is refused, and the model packed and written again.
`specdec cache list` / `specdec cache clear` show and remove entries."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import nn

import specdec.models.native as native
from specdec.machine import cache_root
from specdec.models.building import build_lean, lean_linear_shapes
from specdec.models.checkpoint import Checkpoint
from specdec.models.fused_layer import FusedDecoderLayer, packed_format
from specdec.models.int4 import Int4Linear, PackedLinear
from specdec.models.memory import ModelSize, check_fits
from specdec.models.precisions import Packer, finish_network
from specdec.models.quantize import Int8Linear
from specdec.models.transformer import DecoderLayer, LlamaFamilyModel, SubsetHead, TransformerConfig, rope_frequencies
from specdec.models.w8a32 import W8A32Linear

MANIFEST = "manifest.json"
LINEAR_TYPES: dict[str, type[nn.Module]] = {"int4": Int4Linear, "w8a32": W8A32Linear, "int8": Int8Linear}
SAY_FROM_BYTES = 64 << 20  # a smaller model packs in well under a second: no lines about it
UNCHECKED = ("embed_tokens.safetensors",)  # read a few rows a token: a checksum would read all of it


def store_root() -> Path:
    return cache_root() / "packed"


class DamagedEntry(ValueError):
    """An entry whose files are not what its manifest says (truncated, changed, missing)."""


@dataclass(frozen=True)
class Entry:
    folder: Path
    manifest: dict

    @property
    def nbytes(self) -> int:
        return sum(file["size"] for file in self.manifest["files"].values())


def code_key() -> str:
    """The code that packed layouts and the model's structure come from (this package's models and
    kernels) and the kernel library built here: a new one packs anew."""
    digest = hashlib.sha256(native.library_key().encode())
    models = Path(__file__).parent
    for path in sorted([*models.glob("*.py"), *(models / "kernels").iterdir()]):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def entry_key(weights: Checkpoint, hf_config, quantize: str, output_tokens: torch.Tensor | None) -> str:
    digest = hashlib.sha256(f"{weights.fingerprint()}|{quantize}|{code_key()}|".encode())
    digest.update(hf_config.to_json_string(use_diff=False).encode())
    if output_tokens is not None:
        digest.update(output_tokens.numpy().tobytes())
    return digest.hexdigest()[:16]


def own_forward(weights: Checkpoint, hf_config, dtype: torch.dtype, device: str, name: str, source: str,
                quantize: str | None, output_tokens: torch.Tensor | None = None) -> LlamaFamilyModel:
    """The own forward from ``weights``, read part by part; packed in ``quantize`` on the CPU, from
    its packed copy on disk where one is stored (packed_store), else packed and stored."""
    TransformerConfig.from_hf(hf_config)  # an unsupported architecture fails before reading weights
    if quantize is not None and device == "cpu":
        return packed_model(weights, hf_config, name, source, quantize, output_tokens)
    if quantize is not None:
        raise ValueError(f"{quantize} runs on CPU only; use --device cpu or drop --quantize")
    if device == "cpu":
        check_fits(name, ModelSize.of(hf_config), None, dtype.itemsize)
    return build_lean(weights, hf_config, dtype, device, source, output_tokens=output_tokens)


def packed_model(weights: Checkpoint, hf_config, name: str, source: str, quantize: str,
                 output_tokens: torch.Tensor | None = None, say: Callable[[str], None] | None = None,
                 ) -> LlamaFamilyModel:
    """The own forward in ``quantize`` on the CPU: read from its entry where one is stored and
    whole, else packed from ``weights`` part by part and written for next time."""
    say = say or (_stderr_line if weights.nbytes >= SAY_FROM_BYTES else lambda text: None)
    folder = store_root() / f"{_safe(name)}-{quantize}-{entry_key(weights, hf_config, quantize, output_tokens)}"
    check_fits(name, ModelSize.of(hf_config), quantize, packing=not (folder / MANIFEST).is_file())
    # The kernel and layer checks (cached per machine) decide again what runs: an entry stays true to them.
    packer = Packer(quantize, lean_linear_shapes(hf_config, None if output_tokens is None else len(output_tokens)))
    if (folder / MANIFEST).is_file():
        try:
            return read_entry(folder, hf_config, packer)
        except (DamagedEntry, OSError, ValueError, KeyError) as error:
            say(f"the packed copy at {folder} cannot be used ({error}); packing {name} again")
            shutil.rmtree(folder, ignore_errors=True)
    return _pack_and_write(weights, hf_config, name, source, packer, output_tokens, folder, say)


def read_entry(folder: Path, hf_config, packer: Packer) -> LlamaFamilyModel:
    """The model an entry holds, its tensors memory-mapped from its files (checked first); its
    layers compiled where ``packer`` (this machine's checks) says the compiled layer runs."""
    from safetensors import safe_open

    manifest = json.loads((folder / MANIFEST).read_text())
    if manifest["quantized"] != packer.runs:
        raise DamagedEntry(f"it holds {manifest['quantized']} linears, and {packer.runs} runs here now")
    tensors: dict[str, torch.Tensor] = {}
    for file_name, expected in manifest["files"].items():
        path = folder / file_name
        if not path.is_file() or path.stat().st_size != expected["size"]:
            raise DamagedEntry(f"{file_name} is missing or not {expected['size']} bytes")
        if file_name not in UNCHECKED and _crc32(path) != expected["crc32"]:
            raise DamagedEntry(f"{file_name}'s checksum differs from the one written")
        with safe_open(str(path), framework="pt") as handle:
            tensors.update((name, handle.get_tensor(name)) for name in handle.keys())
    config = TransformerConfig.from_hf(hf_config)
    ropes = rope_frequencies(hf_config, config)
    with torch.device("meta"):
        model = LlamaFamilyModel(config, ropes)
        if manifest["subset_head"]:
            model.lm_head = SubsetHead(cast(nn.Linear, model.lm_head).weight,
                                       torch.zeros(manifest["subset_head"], dtype=torch.long), config.vocab_size)
    for path, spec in manifest["linears"].items():
        model.set_submodule(path, _linear(spec, path, tensors))
    for index in manifest["fused_layers"] if packer.layer_problem is None else ():
        model.layers[index] = FusedDecoderLayer(model.layers[index])
    rest = {name: tensor for name, tensor in tensors.items()
            if not any(name.startswith(path + ".") for path in manifest["linears"])}
    missing, unexpected = model.load_state_dict(rest, strict=False, assign=True)
    missing = [name for name in missing if not any(name.startswith(path + ".") for path in manifest["linears"])]
    if missing or unexpected:
        raise DamagedEntry(f"its tensors do not make the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.eval()
    model.set_rope_tables(ropes)
    model.quantized, model.quantize_notice = manifest["quantized"], manifest["notice"]
    finish_network(model, packer.layer_problem)
    return model


def _linear(spec: dict, path: str, tensors: dict[str, torch.Tensor]) -> nn.Module:
    bias = tensors.get(f"{path}.bias")
    if spec["type"] == "int8":
        return Int8Linear(tensors[f"{path}.weight_int8"], tensors[f"{path}.weight_scale"], bias)
    packed = LINEAR_TYPES[spec["type"]]
    assert issubclass(packed, PackedLinear)
    return packed(tensors[f"{path}.records"], spec["in"], spec["out"], bias)


def _pack_and_write(weights: Checkpoint, hf_config, name: str, source: str, packer: Packer,
                    output_tokens: torch.Tensor | None, folder: Path, say: Callable[[str], None]) -> LlamaFamilyModel:
    quantize = packer.asked
    partial = folder.with_name(f"{folder.name}.{os.getpid()}.partial")
    writer = _Writer(partial, packer.plain_int8)
    say(f"packing {name} in {quantize} once, layer by layer ({weights.nbytes / 2**30:.2f} GiB of weights read); "
        f"later loads read it from {folder}")
    started = time.perf_counter()
    with _progress_bar(show=sys.stderr.isatty() and weights.nbytes >= SAY_FROM_BYTES) as progress:
        network = build_lean(weights, hf_config, torch.float32, "cpu", source, packer=packer,
                             output_tokens=output_tokens, on_part=writer.part,
                             progress=lambda done, total: progress(done, total, writer.written))
    writer.finish(folder, {"source": source, **_manifest(network, packer, writer)})
    _remove_older(folder, source)
    say(f"packed {name} in {quantize} in {time.perf_counter() - started:.1f} s: "
        f"{writer.written / 2**30:.2f} GiB on disk" + ("" if writer.failed is None else
                                                        f" (not stored: {writer.failed})"))
    return network


@contextlib.contextmanager
def _progress_bar(show: bool) -> Iterator[Callable[[int, int, int], None]]:
    """A terminal's progress bar of the packing (parts done of all, bytes written); elsewhere nothing
    (the lines before and after say what runs)."""
    if not show:
        yield lambda done, total, written: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("packing"), BarColumn(), MofNCompleteColumn(), TextColumn("parts, {task.fields[written]}"),
               TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("packing", total=None, written="0.00 GiB written")

        def update(done: int, total: int, written: int) -> None:
            bar.update(task, completed=done, total=total, written=f"{written / 2**30:.2f} GiB written")

        yield update


def _manifest(network: LlamaFamilyModel, packer: Packer, writer: _Writer) -> dict:
    linears = {path: {"type": _linear_type(module), "in": module.in_features, "out": module.out_features}
               for path, module in network.named_modules() if isinstance(module, (PackedLinear, Int8Linear))}
    head = network.lm_head
    return {
        "version": 1, "quantized": network.quantized, "notice": packer.notice(),
        "linears": linears, "subset_head": head.token_ids.shape[0] if isinstance(head, SubsetHead) else 0,
        # The layers whose linears share the packed format: compiled where the layer check passes.
        "fused_layers": [index for index, layer in enumerate(network.layers)
                         if packer.format is not None and packed_format(cast(DecoderLayer, layer)) == packer.format],
        "files": writer.files,
    }


def _linear_type(module: nn.Module) -> str:
    return next(name for name, kind in LINEAR_TYPES.items() if type(module) is kind)


class _Writer:
    """Each finished part into its own file, as the build produces it; the folder renamed into
    place when the manifest is written. A failure (disk full, read-only cache) is said once and the
    model still loads: only the next start pays for packing again."""

    def __init__(self, partial: Path, plain_int8: dict[Int8Linear, torch.Tensor]) -> None:
        self.partial = partial
        self.plain_int8 = plain_int8  # the packer's: each Int8Linear's weight in the plain layout
        self.files: dict[str, dict] = {}
        self.written = 0
        self.failed: str | None = None

    def part(self, prefix: str, module: nn.Module) -> None:
        if self.failed is not None:
            return
        from safetensors.torch import save_file

        tensors = {name: tensor.contiguous() for name, tensor in module.state_dict(prefix=prefix).items()}
        for name, child in module.named_modules(prefix=prefix.rstrip(".")):
            if isinstance(child, Int8Linear):
                tensors[f"{name}.weight_int8"] = self.plain_int8.pop(child)
        path = self.partial / f"{prefix.rstrip('.')}.safetensors"
        try:
            self.partial.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(path))
        except (OSError, RuntimeError) as error:
            self.failed = f"{type(error).__name__}: {error}"
            shutil.rmtree(self.partial, ignore_errors=True)
            return
        self.files[path.name] = {"size": path.stat().st_size, "crc32": _crc32(path)}
        self.written += path.stat().st_size

    def finish(self, folder: Path, manifest: dict) -> None:
        if self.failed is not None:
            return
        try:
            (self.partial / MANIFEST).write_text(json.dumps(manifest, indent=1))
            self.partial.rename(folder)
        except OSError as error:  # another process stored it first, or the folder is read-only
            shutil.rmtree(self.partial, ignore_errors=True)
            if not (folder / MANIFEST).is_file():
                self.failed = f"{type(error).__name__}: {error}"


def _crc32(path: Path) -> int:
    """The file's CRC-32, read through a memory map: the pages it reads are the page cache's, which
    the model's own mapping then shares (no copy of the file in this process)."""
    import mmap

    with path.open("rb") as file:
        if path.stat().st_size == 0:
            return 0
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return zlib.crc32(mapped)


def _remove_older(folder: Path, source: str) -> None:
    """Entries of the same checkpoint in the same precision written before this one (by an older
    specdec, or before a weight file changed): no load reads them again."""
    name_and_precision = folder.name.rsplit("-", 1)[0]
    for entry in entries():
        if entry.folder != folder and entry.manifest.get("source") == source and \
                entry.folder.name.rsplit("-", 1)[0] == name_and_precision:
            shutil.rmtree(entry.folder, ignore_errors=True)


def _safe(name: str) -> str:
    return "".join(character if character.isalnum() or character in "-._" else "-" for character in name)


def _stderr_line(text: str) -> None:
    print(text, file=sys.stderr)


def entries() -> list[Entry]:
    """The stored entries (complete ones: a manifest written), largest first."""
    root = store_root()
    found = []
    for manifest in root.glob(f"*/{MANIFEST}") if root.is_dir() else []:
        try:
            found.append(Entry(manifest.parent, json.loads(manifest.read_text())))
        except (OSError, ValueError):
            continue
    return sorted(found, key=lambda entry: -entry.nbytes)
