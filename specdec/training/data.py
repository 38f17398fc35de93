"""Corpus handling for `specdec train`: files -> held-out split -> BPE tokenizer -> token stream."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from specdec.corpus_files import read_text

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def is_heldout(path: Path, fraction: float) -> bool:
    """A file's side of the split depends only on its name, so it is stable across runs."""
    digest = hashlib.sha1(f"{path.parent.name}/{path.name}".encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < fraction


def split_files(files: Sequence[Path], heldout_fraction: float) -> tuple[list[Path], list[Path]]:
    train = [f for f in files if not is_heldout(f, heldout_fraction)]
    heldout = [f for f in files if is_heldout(f, heldout_fraction)]
    if not train or not heldout:
        raise ValueError(f"{len(files)} files give an empty train or held-out side at fraction {heldout_fraction}")
    return train, heldout


def train_tokenizer(files: Sequence[Path], vocab_size: int):
    """A byte-level BPE tokenizer (tokenizers library), wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator((read_text(f) for f in files), trainer=trainer, length=len(files))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, bos_token=EOS_TOKEN,
        model_max_length=1_000_000,
    )


def encode_files(tokenizer, files: Iterable[Path]) -> np.ndarray:
    """One token stream: every document followed by the end-of-text token."""
    eos = tokenizer.eos_token_id
    texts = [read_text(f) for f in files]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    stream = np.fromiter((t for ids in encoded for t in (*ids, eos)), dtype=np.int32)
    return stream


class TokenWindows:
    """Random (input, label) windows of seq_len + 1 tokens from a token stream."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int) -> None:
        if tokens.shape[0] <= seq_len + 1:
            raise ValueError(f"the corpus has {tokens.shape[0]} tokens, fewer than one window of {seq_len + 1}")
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.seq_len, self.batch_size = seq_len, batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def next_batch(self) -> torch.Tensor:  # [batch, seq_len + 1]
        starts = torch.randint(0, self.tokens.shape[0] - self.seq_len - 1, (self.batch_size,), generator=self.generator)
        return torch.stack([self.tokens[s : s + self.seq_len + 1] for s in starts.tolist()])

    def sequential(self, max_windows: int) -> Iterable[torch.Tensor]:  # [1, seq_len + 1] each
        """Non-overlapping windows from the start, for a deterministic evaluation."""
        step = self.seq_len + 1
        for index in range(min(max_windows, self.tokens.shape[0] // step)):
            yield self.tokens[index * step : (index + 1) * step][None]


def code_prompts(files: Sequence[Path], count: int, context_lines: int = 8, seed: int = 0) -> list[dict]:
    """Completion prompts from held-out files: a function's signature and the lines before it,
    ending where the model must write the body. Spread over files, deterministic."""
    import random

    # Each candidate keeps its own few lines, not its file's: the files of site-packages held whole
    # took gigabytes.
    candidates: list[tuple[Path, int, str]] = []
    for file in files:
        lines = read_text(file).splitlines()
        for number, line in enumerate(lines):
            stripped = line.strip()
            if stripped.startswith("def ") and stripped.endswith(":") and number >= 2:
                text = "\n".join(lines[max(0, number - context_lines) : number + 1]) + "\n"
                candidates.append((file, number, text))
    random.Random(seed).shuffle(candidates)
    prompts, per_file = [], dict[Path, int]()
    for file, number, text in candidates:
        if per_file.get(file, 0) >= 2:
            continue
        per_file[file] = per_file.get(file, 0) + 1
        prompts.append({"category": "code-completion", "id": f"{file.name}:{number + 1}", "prompt": text})
        if len(prompts) == count:
            break
    return prompts
