"""Building a model from weights already in memory: the own forward from transformers-named
tensors, and the end tokens a config and a tokenizer name. Below both ways of reading weights
(loading.py: folders and the Hub; gguf.py: GGUF files dequantized), so neither imports the other."""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.models.architectures import FAMILIES
from specdec.models.transformer import LlamaFamilyModel, TransformerConfig, rope_frequencies

# A draft folder may name the only tokens it proposes (SubsetHead); the own forward honours it.
OUTPUT_TOKENS_FILE = "output_tokens.json"
LAYERS_FILE = "layers.safetensors"  # a distilled draft's trained layers, without the teacher's embedding

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def fused_state_dict(raw: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """Map transformers' parameter names onto the own forward: q/k/v and gate/up fused (or taken
    fused: phi3), the family's norms under the layer's names, gemma's (1 + weight) norms folded,
    granite's residual multiplier folded into o_proj and down_proj."""
    family = FAMILIES[config.model_type]
    offset = 1.0 if family.norm_offset else 0.0

    def norm(name: str) -> torch.Tensor:  # (1 + weight) in float32, as gemma's reference computes it
        return raw[name].float() + offset if offset else raw[name]

    def scaled(name: str) -> torch.Tensor:  # granite's residual multiplier (no copy where it is 1)
        return raw[name] * config.residual_scale if config.residual_scale != 1.0 else raw[name]

    state = {"embed_tokens.weight": raw["model.embed_tokens.weight"], "norm.weight": norm("model.norm.weight")}
    # Tied checkpoints may omit lm_head.weight; the loader re-ties it to the embedding after loading.
    state["lm_head.weight"] = state["embed_tokens.weight"] if config.tie_word_embeddings else raw["lm_head.weight"]
    for i in range(config.num_layers):
        source, target = f"model.layers.{i}.", f"layers.{i}."
        attention, mlp = source + "self_attn.", source + "mlp."
        if family.fused_checkpoint:
            state[target + "qkv_proj.weight"] = raw[attention + "qkv_proj.weight"]
            state[target + "gate_up_proj.weight"] = raw[mlp + "gate_up_proj.weight"]
        else:
            state[target + "qkv_proj.weight"] = torch.cat([raw[attention + f"{n}_proj.weight"] for n in "qkv"])
            state[target + "gate_up_proj.weight"] = torch.cat(
                [raw[mlp + "gate_proj.weight"], raw[mlp + "up_proj.weight"]])
        if config.attention_bias:
            state[target + "qkv_proj.bias"] = torch.cat([raw[attention + f"{n}_proj.bias"] for n in "qkv"])
        state[target + "o_proj.weight"] = scaled(attention + "o_proj.weight")
        if config.output_bias:
            state[target + "o_proj.bias"] = scaled(attention + "o_proj.bias")
        if config.mlp_bias:
            state[target + "gate_up_proj.bias"] = torch.cat([raw[mlp + "gate_proj.bias"], raw[mlp + "up_proj.bias"]])
        state[target + "down_proj.weight"] = scaled(mlp + "down_proj.weight")
        if config.mlp_bias:
            state[target + "down_proj.bias"] = scaled(mlp + "down_proj.bias")
        if config.qk_norm is not None:
            state[target + "q_norm.weight"] = norm(attention + "q_norm.weight")
            state[target + "k_norm.weight"] = norm(attention + "k_norm.weight")
        for ours, theirs in zip(NORM_SLOTS, family.norm_names, strict=True):
            if theirs is not None:
                state[target + ours] = norm(source + theirs + ".weight")
    return state


# The layer's four norms (transformer.DecoderLayer), in the order of Family.norm_names.
NORM_SLOTS = ("input_norm.weight", "attention_out_norm.weight", "post_attention_norm.weight", "mlp_out_norm.weight")


def build_lean(
    raw: dict[str, torch.Tensor], hf_config, dtype: torch.dtype, device: str, source: str
) -> LlamaFamilyModel:
    """The own forward from transformers-named weights (``source`` names where they came from)."""
    config = TransformerConfig.from_hf(hf_config)
    ropes = rope_frequencies(hf_config, config)
    try:
        state = fused_state_dict(raw, config)
    except KeyError as missing:
        raise ValueError(f"weight {missing} is missing from {source}") from None
    with torch.device("meta"):
        model = LlamaFamilyModel(config, ropes)
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model = model.to(device=device, dtype=dtype).eval()
    # Rope tables stay float32 whatever the weights' dtype, as in transformers.
    model.set_rope_tables({name: (inv_freq.to(device), scaling) for name, (inv_freq, scaling) in ropes.items()})
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
