"""A GGUF file dequantized into specdec's own forward (gguf and accelerate are dependencies):
transformers reads the GGUF's config, tokenizer and weights (dequantized to float32), and the
own forward (its families: models/architectures.py) runs them in any dtype, int8 included. For
llama.cpp's own kernels on the quantized weights, use the llama.cpp backend instead."""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.models.base import LanguageModel
from specdec.models.building import DTYPES, end_token_ids
from specdec.models.transformer import TransformerConfig, UnsupportedByLeanModel


def load_gguf_dequantized(path: Path, dtype: str, device: str, quantize: str | None,
                          max_context: int | None, exact: bool = True) -> LanguageModel:
    try:
        import accelerate  # noqa: F401 - transformers needs both to read a GGUF
        import gguf  # noqa: F401
    except ImportError:
        raise ValueError("dequantizing a GGUF file needs gguf and accelerate: pip install gguf accelerate "
                         '(or run it on llama.cpp\'s kernels: pip install "specdec[llama-cpp]")') from None
    from transformers import AutoConfig, AutoTokenizer

    from specdec.models.checkpoint import GGUFCheckpoint
    from specdec.models.packed_store import own_forward

    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    folder, name = str(path.parent), path.name
    try:
        hf_config = AutoConfig.from_pretrained(folder, gguf_file=name)
        TransformerConfig.from_hf(hf_config)  # an unsupported architecture: before the tokenizer and weights
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        weights = GGUFCheckpoint(path, hf_config)
    except UnsupportedByLeanModel as reason:
        raise ValueError(f"{path}: specdec's own forward cannot run this {hf_config.model_type} model: {reason}; "
                         'llama.cpp can: pip install "specdec[llama-cpp]" (then --backend llama.cpp)') from None
    except (ValueError, OSError, KeyError, NotImplementedError) as error:
        raise ValueError(f"could not read {path} as a GGUF model for the own forward: {str(error).splitlines()[0]} "
                         '(llama.cpp runs every GGUF architecture: pip install "specdec[llama-cpp]", then '
                         "--backend llama.cpp)") from None
    network = own_forward(weights, hf_config, DTYPES[dtype], device, path.stem, str(path), quantize)
    if exact:
        network.make_batch_invariant()
    context = network.config.max_position_embeddings
    return LanguageModel(network=network, tokenizer=tokenizer, name=path.stem, vocab_size=hf_config.vocab_size,
                         max_context=min(context, max_context) if max_context else context,
                         eos_token_ids=end_token_ids(hf_config.eos_token_id, tokenizer.eos_token_id),
                         backend="specdec", dtype=DTYPES[dtype], device=torch.device(device), path=str(path))
