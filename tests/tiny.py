"""Tiny random models saved as Hugging Face folders, shared by the tests (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_SHAPE = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
)


def make_config(model_type: str, **overrides):
    from transformers import AutoConfig

    settings = {**TINY_SHAPE, **overrides}
    if model_type == "qwen2":
        settings.setdefault("use_sliding_window", False)
    return AutoConfig.for_model(model_type, **settings)


def save_random_model(
    folder: Path, model_type: str = "llama", seed: int = 0, init_scale: float = 0.2,
    perturb_from: Path | None = None, perturb_scale: float = 0.0, tokenizer: bool = True, **overrides,
) -> Path:
    """A random model; large init_scale gives peaked distributions (greedy argmax far from ties).
    With perturb_from, copy that model and add noise: a draft that agrees with it only partly."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if perturb_from is not None:
        model = AutoModelForCausalLM.from_pretrained(str(perturb_from), dtype=torch.float32)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(perturb_scale * torch.randn_like(parameter))
    else:
        model = AutoModelForCausalLM.from_config(make_config(model_type, **overrides), dtype=torch.float32)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "norm" not in name:
                    parameter.normal_(0.0, init_scale)
    model.save_pretrained(str(folder))
    if tokenizer:
        save_char_tokenizer(folder, model.config.vocab_size)
    return folder


def save_char_tokenizer(folder: Path, vocab_size: int) -> None:
    """A character-level tokenizer: ids 0-2 special, then printable characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = [chr(c) for c in range(32, 127)][: vocab_size - 3]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{ch: i + 3 for i, ch in enumerate(alphabet)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(folder))


def byte_level_tokenizer(vocab_size: int):
    """The character tokenizer's ids (0-2 special, then printable characters) as a byte-level BPE
    without merges: what a grammar engine reads (llguidance needs byte-level or sentencepiece
    token texts)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = [chr(c) for c in range(32, 127)][: vocab_size - 3]
    byte_level = ["\u0120" if ch == " " else ch for ch in alphabet]  # the byte-level text of a space
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{text: i + 3 for i, text in enumerate(byte_level)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
