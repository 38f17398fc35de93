"""Building a model from weights already in memory: the own forward from transformers-named
tensors, and the end tokens a config and a tokenizer name. Below both ways of reading weights
(loading.py: folders and the Hub; gguf.py: GGUF files dequantized), so neither imports the other."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from specdec.models.architectures import FAMILIES
from specdec.models.checkpoint import Checkpoint
from specdec.models.transformer import DecoderLayer, LlamaFamilyModel, TransformerConfig, rope_frequencies

if TYPE_CHECKING:
    from specdec.models.precisions import Packer

# A draft folder may name the only tokens it proposes (SubsetHead); the own forward honours it.
OUTPUT_TOKENS_FILE = "output_tokens.json"
LAYERS_FILE = "layers.safetensors"  # a distilled draft's trained layers, without the teacher's embedding

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def top_state(raw: Mapping[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """The embedding, the final norm and the output head under the own forward's names (a tied
    checkpoint may omit lm_head.weight: the embedding's is used)."""
    state = {"embed_tokens.weight": raw["model.embed_tokens.weight"],
             "norm.weight": _norm(raw, "model.norm.weight", FAMILIES[config.model_type].norm_offset)}
    state["lm_head.weight"] = state["embed_tokens.weight"] if config.tie_word_embeddings else raw["lm_head.weight"]
    return state


def layer_state(raw: Mapping[str, torch.Tensor], config: TransformerConfig, index: int) -> dict[str, torch.Tensor]:
    """Layer ``index``'s weights under the own forward's names (DecoderLayer's): q/k/v and gate/up
    fused (or taken fused: phi3), the family's norms under the layer's names, gemma's (1 + weight)
    norms folded, granite's residual multiplier folded into o_proj and down_proj."""
    family = FAMILIES[config.model_type]

    def norm(name: str) -> torch.Tensor:
        return _norm(raw, name, family.norm_offset)

    def scaled(name: str) -> torch.Tensor:  # granite's residual multiplier (no copy where it is 1)
        return raw[name] * config.residual_scale if config.residual_scale != 1.0 else raw[name]

    source = f"model.layers.{index}."
    attention, mlp = source + "self_attn.", source + "mlp."
    state = {}
    if family.fused_checkpoint:
        state["qkv_proj.weight"] = raw[attention + "qkv_proj.weight"]
        state["gate_up_proj.weight"] = raw[mlp + "gate_up_proj.weight"]
    else:
        state["qkv_proj.weight"] = torch.cat([raw[attention + f"{n}_proj.weight"] for n in "qkv"])
        state["gate_up_proj.weight"] = torch.cat([raw[mlp + "gate_proj.weight"], raw[mlp + "up_proj.weight"]])
    if config.attention_bias:
        state["qkv_proj.bias"] = torch.cat([raw[attention + f"{n}_proj.bias"] for n in "qkv"])
    state["o_proj.weight"] = scaled(attention + "o_proj.weight")
    if config.output_bias:
        state["o_proj.bias"] = scaled(attention + "o_proj.bias")
    if config.mlp_bias:
        state["gate_up_proj.bias"] = torch.cat([raw[mlp + "gate_proj.bias"], raw[mlp + "up_proj.bias"]])
    state["down_proj.weight"] = scaled(mlp + "down_proj.weight")
    if config.mlp_bias:
        state["down_proj.bias"] = scaled(mlp + "down_proj.bias")
    if config.qk_norm is not None:
        state["q_norm.weight"] = norm(attention + "q_norm.weight")
        state["k_norm.weight"] = norm(attention + "k_norm.weight")
    for ours, theirs in zip(NORM_SLOTS, family.norm_names, strict=True):
        if theirs is not None:
            state[ours] = norm(source + theirs + ".weight")
    return state


def _norm(raw: Mapping[str, torch.Tensor], name: str, offset: bool) -> torch.Tensor:
    """A norm's weight; gemma's (1 + weight) computed in float32, as its reference does."""
    return raw[name].float() + 1.0 if offset else raw[name]


# The layer's four norms (transformer.DecoderLayer), in the order of Family.norm_names.
NORM_SLOTS = ("input_norm.weight", "attention_out_norm.weight", "post_attention_norm.weight", "mlp_out_norm.weight")


def lean_linear_shapes(hf_config, head_rows: int | None = None) -> set[tuple[int, int]]:
    """(out, in) of every linear of the own forward of ``hf_config`` (the head with ``head_rows``
    outputs where a draft restricts it): what a Packer checks its kernel on before packing."""
    from specdec.models.precisions import linear_shapes

    config = TransformerConfig.from_hf(hf_config)
    with torch.device("meta"):
        layers = nn.ModuleList(DecoderLayer(config, window) for window in set(config.sliding_windows))
    return linear_shapes(layers) | {(head_rows or config.vocab_size, config.hidden_size)}


def build_lean(
    raw: Mapping[str, torch.Tensor], hf_config, dtype: torch.dtype, device: str, source: str, *,
    packer: Packer | None = None, output_tokens: torch.Tensor | None = None,
    on_part: Callable[[str, nn.Module], None] | None = None, progress: Callable[[int, int], None] | None = None,
) -> LlamaFamilyModel:
    """The own forward from transformers-named weights (``source`` names where they came from),
    read part by part: each layer's tensors are read, converted to ``dtype`` and, with a
    ``packer``, packed before the next layer is read, so a packed model's build holds about one
    layer's float weights beside what is packed. ``output_tokens`` restricts the head
    (restrict_output, before packing); ``on_part(prefix, module)`` sees each finished part (a
    layer, the embedding, the final norm, the head); ``progress(done, total)`` counts parts."""
    config = TransformerConfig.from_hf(hf_config)
    ropes = rope_frequencies(hf_config, config)
    with torch.device("meta"):
        model = LlamaFamilyModel(config, ropes)
    parts = config.num_layers + 3

    def owned(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # copies in dtype, off the file mapping
        return {name: tensor.to(device=device, dtype=dtype, copy=True) for name, tensor in state.items()}

    def finished(prefix: str, module: nn.Module, done: int) -> None:
        if isinstance(raw, Checkpoint):
            raw.release()
        if on_part is not None:
            on_part(prefix, module)
        if progress is not None:
            progress(done, parts)

    for index in range(config.num_layers):
        layer = model.layers[index]
        layer.load_state_dict(owned(_read(source, layer_state, raw, config, index)), strict=True, assign=True)
        model.layers[index] = packer.pack(layer) if packer is not None else layer
        finished(f"layers.{index}.", model.layers[index], index + 1)
    top = owned(_read(source, top_state, raw, config))
    model.embed_tokens.weight = nn.Parameter(top["embed_tokens.weight"], requires_grad=False)
    model.norm.weight = nn.Parameter(top["norm.weight"], requires_grad=False)
    finished("embed_tokens.", model.embed_tokens, config.num_layers + 1)
    finished("norm.", model.norm, config.num_layers + 2)
    cast(nn.Linear, model.lm_head).weight = model.embed_tokens.weight if config.tie_word_embeddings else \
        nn.Parameter(top["lm_head.weight"], requires_grad=False)
    del top
    if output_tokens is not None:
        model.restrict_output(output_tokens)
    if packer is not None:
        model.lm_head = packer.pack(model.lm_head)
    finished("lm_head.", model.lm_head, parts)
    model.eval()
    # Rope tables stay float32 whatever the weights' dtype, as in transformers.
    model.set_rope_tables({name: (inv_freq.to(device), scaling) for name, (inv_freq, scaling) in ropes.items()})
    if packer is not None:
        packer.finish(model)
    return model


def _read(source: str, state: Callable[..., dict[str, torch.Tensor]], *arguments) -> dict[str, torch.Tensor]:
    """``state(*arguments)``; a missing weight is one line naming it and ``source``."""
    try:
        return state(*arguments)
    except KeyError as missing:
        raise ValueError(f"weight {missing} is missing from {source}") from None


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
