"""A tiny model folder written as a GGUF file with the `gguf` package, as llama.cpp's converter
names and stores it (tensor names from gguf's own map per architecture, the metadata keys that
transformers' GGUF reader reads, gemma's norms stored as 1 + weight, float32 tensors), so that a
test can load the file back and compare it with its folder."""

from __future__ import annotations

from pathlib import Path


def write_gguf(folder: Path, out: Path, architecture: str) -> Path:
    import gguf
    import numpy as np
    import torch
    from tiny import byte_level_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    config = AutoConfig.from_pretrained(str(folder))
    state = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).state_dict()
    writer = gguf.GGUFWriter(str(out), architecture)
    for key, attribute in GGUF_CONFIG_MAPPING.get(architecture, {}).items():  # (none: a reader without it)
        value = None if attribute is None else getattr(config, attribute, None)
        if value is None or key == "vocab_size":
            continue
        (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(f"{architecture}.{key}", value)
    tokenizer = byte_level_tokenizer(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([tokenizer.convert_ids_to_tokens(i) for i in range(config.vocab_size)])
    writer.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (config.vocab_size - 3))
    writer.add_token_merges([])
    writer.add_token_scores([0.0] * config.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    arch = {name: enum for enum, name in gguf.MODEL_ARCH_NAMES.items()}[architecture]
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.numpy().astype(np.float32)
        if architecture.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1  # llama.cpp stores gemma's (1 + weight) norms; readers subtract the 1
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
