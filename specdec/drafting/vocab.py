"""Pairing a draft with a target: compare tokenizers, not embedding sizes.

Two checkpoints often share one tokenizer but pad their embeddings to different row counts
(Qwen2.5-7B has 152064 rows, Qwen2.5-0.5B 151936, one tokenizer): the draft then works as is,
its logits cut or padded to the target's row count (see PaddedLogits). Checkpoints with
different tokenizers are paired through a TranslatingDrafter (specdec.drafting.translate).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from specdec.models.base import Attention, Cache, ForwardOutput, LanguageModel, Network


def same_tokenizer(first: Any, second: Any) -> bool:
    """Whether two tokenizers map the same strings to the same ids (special tokens included).
    The vocabularies are compared, not their sizes: a padded embedding changes no token."""
    if first is second:
        return True
    if first is None or second is None:
        return False
    return first.get_vocab() == second.get_vocab()


class PaddedLogits:
    """A network whose logits have ``vocab_size`` columns: extra columns cut off, missing ones
    filled with -inf (probability 0). Used for a draft whose embedding is padded to another row
    count than the target's under the same tokenizer: q then ranges over the target's rows, as
    verification expects, and the draft samples from exactly that q (lossless). Rows past the
    tokenizer's real vocabulary are padding, so cutting them drops no real token."""

    def __init__(self, network: Network, vocab_size: int) -> None:
        self.network, self.vocab_size = network, vocab_size

    def __getattr__(self, name: str) -> Any:  # the wrapped network's other attributes (config, ...)
        return getattr(self.network, name)

    def new_cache(self, max_length: int, rows: int = 1) -> Cache:
        return self.network.new_cache(max_length, rows)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: Cache, attention: Attention,
                 want_logits: bool = True, want_hidden: bool = False) -> ForwardOutput:
        output = self.network(tokens, positions, cache, attention, want_logits, want_hidden)
        logits = output.logits  # [n, draft rows]
        if logits is None or logits.shape[-1] == self.vocab_size:
            return output
        if logits.shape[-1] > self.vocab_size:
            resized = logits[:, : self.vocab_size]
        else:
            resized = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
            resized[:, : logits.shape[-1]] = logits
        return ForwardOutput(resized, output.hidden)


def fit_to_target(draft: LanguageModel, target: LanguageModel) -> LanguageModel:
    """The draft with logits over the target's rows (same tokenizer, other padding), or the draft
    itself when the row counts already agree."""
    if draft.vocab_size == target.vocab_size:
        return draft
    return dataclasses.replace(draft, network=PaddedLogits(draft.network, target.vocab_size),
                               vocab_size=target.vocab_size)


def vocabulary_mismatch(draft: LanguageModel, target: LanguageModel) -> str | None:
    """Why the draft cannot draft in the target's token ids directly (None: it can)."""
    if draft.tokenizer is None or target.tokenizer is None:
        if draft.vocab_size == target.vocab_size:
            return None  # token-id models (tests, synthetic benchmarks): one vocabulary by construction
        return (f"draft and target vocabularies differ ({draft.vocab_size} vs {target.vocab_size} tokens) and "
                "a model without a tokenizer cannot be translated")
    if same_tokenizer(draft.tokenizer, target.tokenizer):
        return None
    return (f"the draft {draft.name!r} ({len(draft.tokenizer)} tokens) and the target {target.name!r} "
            f"({len(target.tokenizer)} tokens) have different tokenizers")
