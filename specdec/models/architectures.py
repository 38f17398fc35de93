"""The model families the own forward runs, as data: what each adds to a Llama-style decoder layer
(q/k norms, where the norms sit, the MLP's activation, scales) and how its checkpoint names its
weights. transformer.py reads a family's traits and the config's values into one TransformerConfig;
building.py reads the names. A model type not here goes to the transformers adapter, with the
reason in one line (UNSUPPORTED_REASONS, or "not one of ...")."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """What a model type adds to the Llama layer (pre-norm, SiLU-gated MLP, RoPE on every layer)."""

    qk_norm: str | None = None  # "head": RMSNorm per head over head_dim; "projection": over all q (k) heads
    pre_norms: bool = True  # RMSNorm on the input of attention and of the MLP
    post_norms: bool = False  # RMSNorm on the output of attention and of the MLP, before the residual add
    norm_offset: bool = False  # RMSNorm scales by (1 + weight) (gemma): folded into the weights at load
    embedding_scale_sqrt_hidden: bool = False  # embeddings times sqrt(hidden_size) (gemma)
    qkv_bias_always: bool = False  # q, k and v carry a bias whatever attention_bias says (qwen2)
    output_bias_with_attention_bias: bool = True  # attention_bias puts a bias on o_proj too (llama)
    fused_checkpoint: bool = False  # the checkpoint stores qkv_proj and gate_up_proj fused (phi3)
    # Checkpoint names of the four per-layer norms, in this order: attention input, attention
    # output, MLP input, MLP output (None: the family has no such norm).
    norm_names: tuple[str | None, str | None, str | None, str | None] = (
        "input_layernorm", None, "post_attention_layernorm", None)


GEMMA_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")

FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(qkv_bias_always=True, output_bias_with_attention_bias=False),
    "qwen3": Family(qk_norm="head"),
    "smollm3": Family(),  # no_rope_layers: read by TransformerConfig
    "granite": Family(),  # its multipliers: read by TransformerConfig
    "phi3": Family(fused_checkpoint=True),
    "olmo2": Family(qk_norm="projection", pre_norms=False, post_norms=True,
                    norm_names=(None, "post_attention_layernorm", None, "post_feedforward_layernorm")),
    "gemma": Family(norm_offset=True, embedding_scale_sqrt_hidden=True),
    "gemma2": Family(post_norms=True, norm_offset=True, embedding_scale_sqrt_hidden=True, norm_names=GEMMA_NORMS),
    "gemma3_text": Family(qk_norm="head", post_norms=True, norm_offset=True, embedding_scale_sqrt_hidden=True,
                          norm_names=GEMMA_NORMS),
}

# Model types known not to fit one dense decoder layer, and what runs them instead.
UNSUPPORTED_REASONS = {
    "qwen3_moe": "a mixture-of-experts model (its experts run on the transformers adapter)",
    "qwen2_moe": "a mixture-of-experts model (its experts run on the transformers adapter)",
    "olmoe": "a mixture-of-experts model (its experts run on the transformers adapter)",
    "granitemoe": "a mixture-of-experts model (its experts run on the transformers adapter)",
    "granitemoeshared": "a mixture-of-experts model (its experts run on the transformers adapter)",
    "mixtral": "a mixture-of-experts model (its experts run on the transformers adapter)",
    "gemma3": "Gemma 3 with its vision tower (image-text-to-text): the own forward runs the text-only gemma3_text",
}

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
