"""Load a Hugging Face-format model folder: config.json, *.safetensors (sharded too), tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specdec.models.base import LanguageModel
from specdec.models.building import DTYPES, OUTPUT_TOKENS_FILE, end_token_ids
from specdec.models.checkpoint import SafetensorsCheckpoint
from specdec.models.packed_store import own_forward
from specdec.models.transformer import (
    LEAN_MODEL_TYPES,
    LlamaFamilyModel,
    UnsupportedByLeanModel,
)
from specdec.names import BACKENDS, QUANTIZATIONS


def _read_config(folder: Path) -> dict:
    if folder.is_file():
        raise ValueError(f"{folder} is a file, not a model folder: pass a Hugging Face-format folder (with "
                         "config.json) or a .gguf file")
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder not found: {folder}")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}: is it a Hugging Face-format model folder?")
    return read_json(config_path)


def read_hf_config(folder: Path, trust_remote_code: bool):
    """transformers' config of a folder; a field of the wrong type is one line naming the file and
    the field (huggingface_hub's strict dataclasses raise a multi-line error of their own type)."""
    from transformers import AutoConfig

    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub, without strict dataclasses
        StrictDataclassError = ValueError
    try:
        return AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    except (TypeError, ValueError, StrictDataclassError) as error:
        detail = " ".join(str(error).split()).replace("Validation error for field", "field")
        raise ValueError(f"{folder / 'config.json'}: {detail}") from None


def model_name(folder: Path) -> str:
    """A folder's name, with its parent's where the name alone says only its role (a converted
    pair's "target" and "draft" folders: "smollm2-135m-instruct/target")."""
    return f"{folder.parent.name}/{folder.name}" if folder.name in ("target", "draft") else folder.name


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(read_json(index)["weight_map"].values()))
        return [folder / shard for shard in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return files


def _load_lean(folder: Path, hf_config, dtype: torch.dtype, device: str, quantize: str | None) -> LlamaFamilyModel:
    output_file = folder / OUTPUT_TOKENS_FILE
    output_tokens = torch.tensor(read_json(output_file)["token_ids"], dtype=torch.long) \
        if output_file.is_file() else None
    weights = SafetensorsCheckpoint(_safetensors_files(folder))
    return own_forward(weights, hf_config, dtype, device, model_name(folder), f"{folder}: the safetensors files",
                       quantize, output_tokens)


def _load_tokenizer(folder: Path):
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (ValueError, OSError, TypeError, KeyError) as error:  # json.JSONDecodeError is a ValueError
        for name in ("tokenizer.json", "tokenizer_config.json"):  # name the file that is not JSON, if one is not
            if (folder / name).is_file():
                read_json(folder / name)
        raise ValueError(f"the tokenizer in {folder} cannot be read: {' '.join(str(error).split())}") from None


def _eos_token_ids(folder: Path, raw_config: dict, tokenizer) -> tuple[int, ...]:
    generation_config = folder / "generation_config.json"
    generation = read_json(generation_config).get("eos_token_id") if generation_config.is_file() else None
    return end_token_ids(raw_config.get("eos_token_id"), generation,
                         tokenizer.eos_token_id if tokenizer is not None else None)


HUB_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
             "tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt"]


def looks_like_hub_id(text: str) -> bool:
    """owner/name, as on the Hugging Face Hub (a local path that exists always wins)."""
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "~")) and not text.endswith(".gguf")


def resolve_model_path(path: str | Path) -> Path:
    """A local folder or file as is; otherwise a Hub id (owner/name) downloaded through
    huggingface_hub into its cache (weights, config and tokenizer only)."""
    local = Path(path).expanduser()
    if local.exists() or not looks_like_hub_id(str(path)):
        return local
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(path), allow_patterns=HUB_FILES))
    except Exception as error:  # noqa: BLE001 - offline, unknown repo, gated repo: one message for all
        raise ValueError(f"{path} is not a local folder, and downloading it from the Hugging Face Hub failed "
                         f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else 'no detail'}); "
                         "offline? pass a local model folder") from None


def _load_gguf(path: Path, backend: str, dtype: str, quantize: str | None, device: str,
               max_context: int | None, exact: bool = True) -> LanguageModel:
    """llama.cpp's kernels when llama-cpp-python is installed (or asked for), else dequantized
    into the own forward (backend "specdec")."""
    if path.suffix != ".gguf":
        raise ValueError(f"the llama.cpp backend loads .gguf files; {path} is not one")
    if backend == "transformers":
        raise ValueError(f"{path} is a GGUF file: run it with --backend llama.cpp or --backend specdec")
    backend = gguf_backend(backend)
    if backend == "specdec":
        from specdec.models.gguf import load_gguf_dequantized

        return load_gguf_dequantized(path, dtype, device, quantize, max_context, exact)
    if quantize is not None or dtype != "float32" or device != "cpu":
        raise ValueError("a GGUF file on llama.cpp keeps its own quantization on the CPU kernels: drop --quantize, "
                         "--dtype and --device (or dequantize it into the own forward: --backend specdec)")
    from specdec.models.llama_cpp import load_gguf

    return load_gguf(path, context_size=max_context or 8192)


def gguf_backend(backend: str) -> str:
    """Where a .gguf file runs under ``backend``: "auto" means llama.cpp's kernels when
    llama-cpp-python is installed, else the own forward ("specdec")."""
    if backend != "auto":
        return backend
    import importlib.util

    return "llama.cpp" if importlib.util.find_spec("llama_cpp") else "specdec"


def load(
    path: str | Path,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    quantize: str | None = None,
    backend: str = "auto",
    trust_remote_code: bool = False,
    max_context: int | None = None,
    exact: bool = True,
    kv_dtype: str | None = None,
) -> LanguageModel:
    """Load a model folder.

    backend: "specdec" (own forward: the families of architectures.py), "transformers" (AutoModelForCausalLM adapter,
    for any architecture) or "auto" (own forward where the architecture is supported).
    quantize: None, "int8" (int8 weights, per-row int8 activations; CPU only), "int4" (4-bit
    weight groups on a kernel compiled and checked on this CPU, int8 where it cannot run) or "w8a32"
    (8-bit weight groups, float32 activations: a 4- or 8-bit GGUF's weights exactly; same kernel terms).
    max_context: cap on the context length (defaults to the config's max_position_embeddings).
    exact: float weights on the own forward score every token of a verify block bit-for-bit as
    alone (make_batch_invariant: linears in fixed 8-row calls, attention per query
    after the prefill), so greedy speculative output equals target-only output. False trades that
    for a cheaper single-token forward (docs/design.md has the measured price). int8 is exact anyway.
    A ``.gguf`` file runs on llama.cpp's kernels (backend "llama.cpp", needs specdec[llama-cpp]).
    kv_dtype: what the own forward's KV cache stores keys and values in, "float32", "bfloat16" or
    "float16" (arithmetic stays in dtype); None: as quantize_model chose (16 bits for int4), else dtype.
    """
    check_load_options(dtype, backend, quantize, device)
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise ValueError(f"unknown kv_dtype {kv_dtype!r}; choose one of {', '.join(KV_DTYPES)}")
    folder = resolve_model_path(path)
    if backend == "llama.cpp" or folder.suffix == ".gguf":
        return with_kv_dtype(_load_gguf(folder, backend, dtype, quantize, device, max_context, exact), kv_dtype)
    raw_config = _check_folder_config(folder, trust_remote_code)
    hf_config = read_hf_config(folder, trust_remote_code)
    network, used_backend = _build_network(folder, hf_config, backend, DTYPES[dtype], device, trust_remote_code,
                                           quantize)
    _set_precision(network, used_backend, folder, exact, quantize)
    tokenizer = _load_tokenizer(folder)
    context = own_context(network, hf_config)
    return with_kv_dtype(LanguageModel(
        network=network,
        tokenizer=tokenizer,
        name=model_name(folder),
        vocab_size=hf_config.vocab_size,
        max_context=min(context, max_context) if max_context else context,
        eos_token_ids=_eos_token_ids(folder, raw_config, tokenizer),
        backend=used_backend,
        dtype=DTYPES[dtype],
        device=torch.device(device),
        path=str(folder),
    ), kv_dtype)


KV_DTYPES = ("float32", "bfloat16", "float16")


def own_context(network, hf_config) -> int:
    """The longest context the network runs: the own forward's may be shorter than the config's
    (longrope: the context its short factors cover, transformer.rope_context)."""
    return network.config.max_position_embeddings if isinstance(network, LlamaFamilyModel) else \
        hf_config.max_position_embeddings


def with_kv_dtype(model: LanguageModel, kv_dtype: str | None) -> LanguageModel:
    """The model, its KV cache storing keys and values in ``kv_dtype`` (None: as loading chose)."""
    if kv_dtype is None:
        return model
    from specdec.models.transformer import LlamaFamilyModel

    if not isinstance(model.network, LlamaFamilyModel):
        raise ValueError(f"--kv-dtype sets the own forward's cache; {model.name} runs on the {model.backend} backend")
    model.network.kv_dtype = DTYPES[kv_dtype]
    return model


def check_load_options(dtype: str, backend: str, quantize: str | None, device: str) -> None:
    """load()'s options, checked before any file is read."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if quantize not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantize!r}; choose {', '.join(map(str, QUANTIZATIONS[1:]))}")
    if quantize and dtype != "float32":
        raise ValueError(f"{quantize} quantization starts from float32 weights; use dtype float32 with it")
    if not (device == "cpu" or device == "cuda" or device.startswith("cuda:") and device[5:].isdigit()):
        raise ValueError(f"unknown device {device!r}; use cpu, cuda or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but torch sees no CUDA GPU")


def _check_folder_config(folder: Path, trust_remote_code: bool) -> dict:
    """config.json, refused when it needs custom code not trusted or names an unknown model type."""
    raw_config = _read_config(folder)
    model_type = raw_config.get("model_type")
    if "auto_map" in raw_config and not trust_remote_code:
        raise ValueError(
            f"{folder} needs custom code from its folder (config.json has auto_map); "
            "pass trust_remote_code=True (CLI: --trust-remote-code) if you trust it"
        )
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING and "auto_map" not in raw_config:
        raise ValueError(
            f"unknown model_type {model_type!r} in {folder / 'config.json'}: specdec's own forward "
            f"supports {', '.join(LEAN_MODEL_TYPES)}, and transformers does not know it either"
        )
    return raw_config


def _build_network(folder: Path, hf_config, backend: str, torch_dtype: torch.dtype, device: str,
                   trust_remote_code: bool, quantize: str | None) -> tuple[Any, str]:
    """The network and the backend it runs on: the own forward where it supports the model (and
    backend allows; packed in ``quantize`` as it is read), else transformers'
    AutoModelForCausalLM behind an adapter."""
    if backend in ("auto", "specdec"):
        try:
            return _load_lean(folder, hf_config, torch_dtype, device, quantize), "specdec"
        except UnsupportedByLeanModel as reason:
            if backend == "specdec":
                raise ValueError(f"{folder}: specdec's own forward cannot run this model: {reason}") from None
    from transformers import AutoModelForCausalLM

    from specdec.models.hf_adapter import HFNetwork
    from specdec.models.memory import ModelSize, check_fits

    if device == "cpu":
        try:
            size = ModelSize.of(hf_config)
        except (AttributeError, TypeError):  # a config without the usual fields: nothing to check against
            size = None
        if size is not None:
            check_fits(f"{model_name(folder)} on the transformers adapter", size, None, torch_dtype.itemsize)
    hf_model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch_dtype, trust_remote_code=trust_remote_code
    ).to(device)
    return HFNetwork(hf_model), "transformers"


def _set_precision(network, used_backend: str, folder: Path, exact: bool, quantize: str | None) -> None:
    """Exact blocks on the own forward (its output head and precision were set as it was built);
    on the adapter, the linears in ``quantize``."""
    if used_backend == "specdec":
        if exact:
            network.make_batch_invariant()
        return
    if quantize is None:
        return
    import warnings

    from specdec.models.precisions import quantize_linears

    warnings.warn(f"{folder.name}: {quantize} through the transformers adapter is not batch-invariant (its "
                  "attention scores a verify block together), so greedy speculative output may differ "
                  f"from {quantize} target-only output in near-ties; the own forward (--backend specdec) is exact",
                  stacklevel=3)
    quantize_linears(network.model, quantize)
    network.quantized = network.model.quantized
