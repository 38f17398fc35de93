"""Building a model from weights already in memory: the own forward from transformers-named
tensors, and the end tokens a config and a tokenizer name. Below both ways of reading weights
(loading.py: folders and the Hub; gguf.py: GGUF files dequantized), so neither imports the other."""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.models.transformer import LlamaFamilyModel, TransformerConfig, rope_inverse_frequencies

# A draft folder may name the only tokens it proposes (SubsetHead); the own forward honours it.
OUTPUT_TOKENS_FILE = "output_tokens.json"
LAYERS_FILE = "layers.safetensors"  # a distilled draft's trained layers, without the teacher's embedding

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def fused_state_dict(raw: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """Map transformers' parameter names onto the lean model, fusing q/k/v and gate/up."""
    state = {
        "embed_tokens.weight": raw["model.embed_tokens.weight"],
        "norm.weight": raw["model.norm.weight"],
    }
    # Tied checkpoints may omit lm_head.weight; the loader re-ties it to the embedding after loading.
    state["lm_head.weight"] = state["embed_tokens.weight"] if config.tie_word_embeddings else raw["lm_head.weight"]
    for i in range(config.num_layers):
        source, target = f"model.layers.{i}.", f"layers.{i}."
        attention, mlp = source + "self_attn.", source + "mlp."
        state[target + "qkv_proj.weight"] = torch.cat([raw[attention + f"{n}_proj.weight"] for n in "qkv"])
        if config.attention_bias:
            state[target + "qkv_proj.bias"] = torch.cat([raw[attention + f"{n}_proj.bias"] for n in "qkv"])
        state[target + "o_proj.weight"] = raw[attention + "o_proj.weight"]
        if config.output_bias:
            state[target + "o_proj.bias"] = raw[attention + "o_proj.bias"]
        state[target + "gate_up_proj.weight"] = torch.cat([raw[mlp + "gate_proj.weight"], raw[mlp + "up_proj.weight"]])
        if config.mlp_bias:
            state[target + "gate_up_proj.bias"] = torch.cat([raw[mlp + "gate_proj.bias"], raw[mlp + "up_proj.bias"]])
        state[target + "down_proj.weight"] = raw[mlp + "down_proj.weight"]
        if config.mlp_bias:
            state[target + "down_proj.bias"] = raw[mlp + "down_proj.bias"]
        state[target + "input_norm.weight"] = raw[source + "input_layernorm.weight"]
        state[target + "post_attention_norm.weight"] = raw[source + "post_attention_layernorm.weight"]
    return state


def build_lean(
    raw: dict[str, torch.Tensor], hf_config, dtype: torch.dtype, device: str, source: str
) -> LlamaFamilyModel:
    """The own forward from transformers-named weights (``source`` names where they came from)."""
    config = TransformerConfig.from_hf(hf_config)
    inv_freq, attention_scaling = rope_inverse_frequencies(hf_config, config.head_dim)
    try:
        state = fused_state_dict(raw, config)
    except KeyError as missing:
        raise ValueError(f"weight {missing} is missing from {source}") from None
    with torch.device("meta"):
        model = LlamaFamilyModel(config, inv_freq, attention_scaling)
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model = model.to(device=device, dtype=dtype).eval()
    # Rope tables stay float32 whatever the weights' dtype, as in transformers.
    model.set_rope_tables(inv_freq.to(device), attention_scaling)
    return model


def end_token_ids(*named) -> tuple[int, ...]:
    """The union of the end tokens that configs and tokenizers name (each an id, a list or None):
    an Instruct model's end-of-turn token is often named in only one of them."""
    ids: list[int] = []
    for entry in named:
        for token in entry if isinstance(entry, list) else [entry]:
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    return tuple(ids)


def assemble_draft(layers_folder: Path, teacher_state: dict[str, torch.Tensor], tokenizer, out: Path) -> None:
    """Write a complete model folder: a distilled draft's layers (``layers_folder``, as specdec train
    saves them) plus the teacher's embedding and tokenizer."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(layers_folder / LAYERS_FILE))
    weights["model.embed_tokens.weight"] = teacher_state["model.embed_tokens.weight"].float().contiguous()
    weights = {name: tensor.float().contiguous() for name, tensor in weights.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "README.md", OUTPUT_TOKENS_FILE):
        if (layers_folder / name).is_file():
            (out / name).write_bytes((layers_folder / name).read_bytes())
    tokenizer.save_pretrained(str(out))
