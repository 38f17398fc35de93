"""A checkpoint read tensor by tensor: safetensors shards (memory-mapped) or a GGUF file's blocks
(dequantized one tensor at a time), under transformers' parameter names. Building a model from one
never holds more than the tensors asked for at once, so a model is packed layer by layer with about
one layer's float32 weights beside what is already packed (building.build_lean)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch


class Checkpoint(Mapping[str, torch.Tensor]):
    """transformers-named tensors, each read when asked for (``checkpoint[name]``)."""

    files: list[Path]  # what the tensors are read from: its fingerprint's inputs

    def fingerprint(self) -> str:
        """The files' names, sizes and modification times: what a packed copy is kept under (a
        changed weight file gets a new key, and is packed again)."""
        digest = hashlib.sha256()
        for path in self.files:
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
        return digest.hexdigest()[:16]

    @property
    def nbytes(self) -> int:
        return sum(path.stat().st_size for path in self.files)

    def release(self) -> None:
        """Let go of what was read so far (a file mapping's pages): called between parts."""


class SafetensorsCheckpoint(Checkpoint):
    """A folder's *.safetensors shards, memory-mapped: a tensor costs memory only once copied."""

    def __init__(self, files: list[Path]) -> None:
        self.files = files
        self._shard: dict[str, Path] = {}
        for path in files:
            self._shard.update((name, path) for name in self._open(path).keys())
        self._handles: dict[Path, Any] = {}

    @staticmethod
    def _open(path: Path) -> Any:
        from safetensors import SafetensorError, safe_open

        try:
            return safe_open(str(path), framework="pt")
        except (SafetensorError, OSError) as error:
            raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupt?): {error}") from None

    def __getitem__(self, name: str) -> torch.Tensor:
        path = self._shard[name]
        if path not in self._handles:
            self._handles[path] = self._open(path)
        return self._handles[path].get_tensor(name)

    def release(self) -> None:
        """Close the mappings: the pages read so far leave this process's memory (a whole
        checkpoint's would otherwise stay resident until the end of the build)."""
        self._handles.clear()

    def __iter__(self) -> Iterator[str]:
        return iter(self._shard)

    def __len__(self) -> int:
        return len(self._shard)


class GGUFCheckpoint(Checkpoint):
    """A GGUF file's tensors dequantized to float32 one at a time, renamed and processed as
    transformers' GGUF loader does (llama's q/k rows un-permuted, gemma's norms less one)."""

    def __init__(self, path: Path, hf_config) -> None:
        import gguf
        from transformers import AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
            load_gguf_checkpoint,
        )

        self.files = [path]
        self._reader = gguf.GGUFReader(str(path))
        self._parsed = load_gguf_checkpoint(str(path), return_tensors=False)
        architecture = bytes(self._reader.fields["general.architecture"].parts[-1]).decode()
        self._processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=self._parsed.get("config", {}))
        with torch.device("meta"):  # only for its parameter names
            names_model = AutoModelForCausalLM.from_config(hf_config)
        self._to_hf = get_gguf_hf_weights_map(names_model, self._processor)
        self._tensors = {self._to_hf[tensor.name]: tensor for tensor in self._reader.tensors
                         if tensor.name in self._to_hf}

    def __getitem__(self, name: str) -> torch.Tensor:
        import numpy as np
        from gguf import dequantize

        tensor = self._tensors[name]
        weights = self._processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name,
                                          tensor_key_mapping=self._to_hf, parsed_parameters=self._parsed).weights
        return torch.from_numpy(np.array(weights, dtype=np.float32, copy=True))  # owned, writable

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)
