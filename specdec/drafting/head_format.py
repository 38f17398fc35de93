"""Draft heads on disk, in the EAGLE-3 layout SpecForge and the EAGLE repository write, so heads
trained elsewhere (on a GPU, with SpecForge) load here and heads trained here load there.

config.json: ``architectures: ["LlamaForCausalLMEagle3"]``, the Llama keys of the one layer,
``vocab_size`` (the target's), ``draft_vocab_size``, ``target_hidden_size`` and
``eagle_config.eagle_aux_hidden_state_layer_ids`` (the target layers read).
model.safetensors: ``fc.weight``, ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
``midlayer.self_attn.{q,k,v,o}_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``,
``norm.weight``, ``lm_head.weight``, ``d2t`` (int64 offsets: target id = draft id + d2t[draft id])
and ``t2d`` (bool over the target vocabulary). The embedding is the target's and is not stored.
Here q/k/v and gate/up are fused into one matmul each (as the target's forward does).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from specdec.drafting.head import DraftHead, HeadConfig, default_feature_layers
from specdec.drafting.head_finder import ARCHITECTURE, check_fits, target_embedding
from specdec.models.base import LanguageModel
from specdec.models.transformer import LlamaFamilyModel, TransformerConfig

CONFIG_FILE, WEIGHTS_FILE, CARD_FILE = "config.json", "model.safetensors", "README.md"


def hf_config(config: HeadConfig, dtype: torch.dtype = torch.float32) -> dict:
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(config.feature_layers)},
    }


def head_config(data: dict, target_layers: int) -> HeadConfig:
    """A HeadConfig from an EAGLE-3 config.json (target_layers: the target's layer count, for the
    default aux layers when the config names none)."""
    if ARCHITECTURE not in data.get("architectures", []):
        raise ValueError(f"not an EAGLE-3 head: config.json architectures {data.get('architectures')} "
                         f"lack {ARCHITECTURE!r}")
    if data.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"an EAGLE-3 head has one decoder layer; this config has {data['num_hidden_layers']}")
    rope = data.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ValueError(f"the head's rope_scaling {rope} is not supported (plain rope only)")
    hidden, heads = data["hidden_size"], data["num_attention_heads"]
    layers = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return HeadConfig(
        hidden_size=hidden, intermediate_size=data["intermediate_size"], num_heads=heads,
        num_kv_heads=data.get("num_key_value_heads") or heads, head_dim=data.get("head_dim") or hidden // heads,
        rms_norm_eps=data.get("rms_norm_eps", 1e-6), rope_theta=data.get("rope_theta", 10000.0),
        vocab_size=data["vocab_size"], draft_vocab_size=data.get("draft_vocab_size") or data["vocab_size"],
        target_hidden_size=data.get("target_hidden_size") or hidden,
        feature_layers=tuple(layers) if layers else default_feature_layers(target_layers),
        max_position_embeddings=data.get("max_position_embeddings", 32768),
    )


def eagle3_tensors(head: DraftHead) -> dict[str, torch.Tensor]:
    """The head's weights under SpecForge's names (q/k/v and gate/up split again)."""
    c, layer = head.config, head.midlayer
    q, k, v = layer.qkv_proj.weight.detach().split(
        [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim])
    gate, up = layer.gate_up_proj.weight.detach().chunk(2)
    tensors = {
        "fc.weight": head.fc.weight, "norm.weight": head.norm.weight, "lm_head.weight": head.lm_head.weight,
        "midlayer.input_layernorm.weight": layer.input_layernorm.weight,
        "midlayer.hidden_norm.weight": layer.hidden_norm.weight,
        "midlayer.post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
        "midlayer.self_attn.q_proj.weight": q, "midlayer.self_attn.k_proj.weight": k,
        "midlayer.self_attn.v_proj.weight": v, "midlayer.self_attn.o_proj.weight": layer.o_proj.weight,
        "midlayer.mlp.gate_proj.weight": gate, "midlayer.mlp.up_proj.weight": up,
        "midlayer.mlp.down_proj.weight": layer.down_proj.weight,
        "d2t": head.d2t, "t2d": head.t2d,
    }
    return {name: tensor.detach().contiguous().cpu() for name, tensor in tensors.items()}


def save_head(head: DraftHead, folder: str | Path, card: str | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write the head (its weights in ``dtype``, default their own) and, when given, its model card."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = dtype or head.dtype
    tensors = {name: tensor.to(dtype) if tensor.is_floating_point() else tensor
               for name, tensor in eagle3_tensors(head).items()}
    (folder / CONFIG_FILE).write_text(json.dumps(hf_config(head.config, dtype), indent=2) + "\n")
    save_file(tensors, str(folder / WEIGHTS_FILE))
    if card is not None:
        (folder / CARD_FILE).write_text(card)
    return folder


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / WEIGHTS_FILE).exists():
        from safetensors.torch import load_file

        return load_file(str(folder / WEIGHTS_FILE))
    if (folder / "pytorch_model.bin").exists():
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no {WEIGHTS_FILE} or pytorch_model.bin in {folder}")


def load_head(folder: str | Path, target: LanguageModel, dtype: torch.dtype = torch.float32,
              quantize: str | None = None, compiled: bool = True) -> DraftHead:
    """An EAGLE-3 head from ``folder``, checked against the target it drafts for. quantize: None,
    "int8", "int4" or "w8a32" for the head's linears (``head_quantization(target)``: as the target runs).
    compiled: packed (int4, w8a32) linears run in the compiled layer calls (drafting/fused_head.py)
    where they check out here; False keeps the torch layer (the reference the tests compare with)."""
    folder = Path(folder)
    if not (folder / CONFIG_FILE).exists():
        raise FileNotFoundError(f"draft head not found: no {CONFIG_FILE} in {folder}")
    network, config, num_layers = target.network, getattr(target.network, "config", None), None
    if config is not None and hasattr(config, "num_layers"):  # own forward
        num_layers = config.num_layers
    elif hasattr(network, "model"):  # the transformers adapter
        num_layers = network.model.config.num_hidden_layers
    if not isinstance(num_layers, int):
        raise ValueError(f"a draft head reads the target's hidden states; the {target.backend} backend gives none "
                         "(load the target with --backend specdec)")
    config = head_config(json.loads((folder / CONFIG_FILE).read_text()), num_layers)
    check_fits(folder, target)  # a head that records another target is refused, whatever its shapes
    embedding = target_embedding(target)  # [vocab, hidden]
    if config.target_hidden_size != embedding.shape[1]:
        raise ValueError(f"the head at {folder} reads features of width {config.target_hidden_size}, the target "
                         f"{target.name} has hidden size {embedding.shape[1]}: a head works only "
                         "with the target it was trained for")
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"the head at {folder} drafts over {config.vocab_size} tokens, the target {target.name} "
                         f"has {target.vocab_size}: a head works only with the target it was trained for")
    if max(config.feature_layers) >= num_layers:
        raise ValueError(f"the head reads target layers {config.feature_layers}; {target.name} has {num_layers}")
    head = DraftHead(config, embedding.to(target.device)).to(dtype)  # copies keep their precision
    tensors = read_tensors(folder)
    missing = [name for name in eagle3_tensors(head) if name not in tensors and name not in ("d2t", "t2d")]
    if missing:
        raise ValueError(f"the head at {folder} lacks tensors {missing}")
    layer = head.midlayer
    with torch.no_grad():
        head.fc.weight.copy_(tensors["fc.weight"])
        head.norm.weight.copy_(tensors["norm.weight"])
        head.lm_head.weight.copy_(tensors["lm_head.weight"])
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            getattr(layer, name).weight.copy_(tensors[f"midlayer.{name}.weight"])
        layer.qkv_proj.weight.copy_(torch.cat([tensors[f"midlayer.self_attn.{p}_proj.weight"] for p in "qkv"]))
        layer.o_proj.weight.copy_(tensors["midlayer.self_attn.o_proj.weight"])
        layer.gate_up_proj.weight.copy_(torch.cat([tensors["midlayer.mlp.gate_proj.weight"],
                                                   tensors["midlayer.mlp.up_proj.weight"]]))
        layer.down_proj.weight.copy_(tensors["midlayer.mlp.down_proj.weight"])
        if "d2t" in tensors:
            head.d2t.copy_(tensors["d2t"].long())
            head.t2d.copy_(tensors["t2d"].bool() if "t2d" in tensors else draft_mask(head))
        else:  # a head over the whole vocabulary
            head.set_draft_vocab(torch.arange(config.draft_vocab_size))
    ids = head.draft_token_ids
    if ids.min() < 0 or ids.max() >= config.vocab_size or ids.unique().shape != ids.shape:
        raise ValueError(f"the head at {folder} has a d2t that maps outside the target's vocabulary or twice")
    head = head.to(device=target.device, dtype=dtype).eval()
    if quantize is not None:
        from specdec.drafting.fused_head import fuse_head
        from specdec.models.precisions import quantize_linears

        quantize_linears(head, quantize)  # q stays the law the draft is drawn from: lossless either way
        if compiled:
            fuse_head(head)  # compiled calls where its linears are packed and the layer checks out here
    return head


def head_quantization(target: LanguageModel) -> str | None:
    """A head drafts in the target's quantization (int8 / int4 / w8a32 linears) when the target has
    one: a float head's weights would cost more to read per draft token than its matmuls."""
    return target.precision if target.precision in ("int8", "int4", "w8a32") else None


def draft_mask(head: DraftHead) -> torch.Tensor:  # [vocab] bool
    mask = torch.zeros(head.config.vocab_size, dtype=torch.bool)
    mask[head.draft_token_ids] = True
    return mask


def target_shape(target: LanguageModel) -> TransformerConfig:
    """The target's TransformerConfig (own forward), which a new head copies its shape from."""
    config = getattr(target.network, "config", None)
    if config is None or not hasattr(config, "num_layers"):
        raise ValueError(f"a new draft head is built for a target on specdec's own forward, not {target.backend}")
    return config


def own_network(target: LanguageModel) -> LlamaFamilyModel:
    """The target's network on specdec's own forward, whose final norm and LM head a head's data reads."""
    if not isinstance(target.network, LlamaFamilyModel):
        raise ValueError(f"a draft head's data is read from a target on specdec's own forward, not {target.backend}")
    return target.network


def widened_head(head: DraftHead, draft_token_ids: torch.Tensor) -> DraftHead:  # [draft_vocab] int64
    """``head`` over a larger draft vocabulary that holds all of its own tokens: the same weights,
    its output rows for its tokens, and for each new token the mean of its rows (at first the
    logits of an average token, not of a random one: training moves them from there)."""
    old_ids = head.draft_token_ids.cpu()
    new_ids = draft_token_ids.cpu().sort().values
    if new_ids.unique().shape != new_ids.shape or not torch.isin(old_ids, new_ids).all():
        raise ValueError("a widened draft vocabulary holds every token of the head's, each once")
    state = {name: tensor for name, tensor in head.state_dict().items() if name not in ("d2t", "t2d")}
    old_rows = state["lm_head.weight"]  # [old draft_vocab, hidden]
    wider = DraftHead(dataclasses.replace(head.config, draft_vocab_size=int(new_ids.shape[0])), head.embed_weight)
    wider = wider.to(device=old_rows.device, dtype=old_rows.dtype)
    wider.set_draft_vocab(new_ids.to(old_rows.device))
    rows = old_rows.mean(0, keepdim=True).repeat(new_ids.shape[0], 1)
    rows[torch.searchsorted(new_ids, old_ids)] = old_rows  # each old token's row where it now sits
    state["lm_head.weight"] = rows
    state.update(d2t=wider.d2t, t2d=wider.t2d)
    wider.load_state_dict(state)
    return wider


def new_head(target: LanguageModel, draft_token_ids: torch.Tensor | None = None, intermediate_size: int | None = None,
             feature_layers: tuple[int, ...] | None = None, rope_theta: float = 10000.0) -> DraftHead:
    """A freshly initialised head for ``target``: its hidden size, heads and embedding, EAGLE-3's
    three feature layers, the draft vocabulary ``draft_token_ids`` [draft_vocab] (all tokens when
    None) and an MLP of ``intermediate_size`` (the target's when None)."""
    shape = target_shape(target)
    draft_token_ids = torch.arange(target.vocab_size) if draft_token_ids is None else draft_token_ids.cpu()
    config = HeadConfig(
        hidden_size=shape.hidden_size, intermediate_size=intermediate_size or shape.intermediate_size,
        num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        rms_norm_eps=shape.rms_norm_eps, rope_theta=rope_theta, vocab_size=target.vocab_size,
        draft_vocab_size=int(draft_token_ids.shape[0]), target_hidden_size=shape.hidden_size,
        feature_layers=feature_layers or default_feature_layers(shape.num_layers),
        max_position_embeddings=target.max_context,
    )
    head = DraftHead(config, target_embedding(target).cpu())
    head.set_draft_vocab(draft_token_ids)
    return head.to(target.device)
