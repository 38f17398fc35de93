"""Pairing a draft with a target: compare tokenizers, not embedding sizes.

What matters for drafting in the target's token ids is that an id means the same string to both
models. Two checkpoints often share one tokenizer but pad their embeddings to different row
counts (Qwen2.5-7B has 152064 rows, Qwen2.5-0.5B 151936, one tokenizer), or one adds a few
special tokens at the end: every id both vocabularies name then names the same string, and the
draft works as is, its logits cut or padded to the target's row count (PaddedLogits).
Tokenizers whose shared ids name different strings are paired through a TranslatingDrafter
(specdec.drafting.translate): text is the common currency.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from specdec.models.base import Attention, Cache, ForwardOutput, LanguageModel, Network


def id_conflicts(first: Any, second: Any) -> int:
    """How many token ids the two tokenizers both name but map to different strings (special
    tokens included); 0 means a draft can propose its own ids to the other model directly."""
    if first is second:
        return 0
    by_id = {index: text for text, index in second.get_vocab().items()}
    return sum(1 for text, index in first.get_vocab().items() if index in by_id and by_id[index] != text)


class PaddedLogits:
    """A network whose logits have ``vocab_size`` columns: extra columns cut off, missing ones
    filled with -inf (probability 0). Used for a draft whose embedding is padded to another row
    count than the target's under the same tokenizer: q then ranges over the target's rows, as
    verification expects, and the draft samples from exactly that q (lossless whatever the cut
    columns held: q is still a distribution and the draft draws from it)."""

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
        return (f"draft and target vocabularies differ ({draft.vocab_size} vs {target.vocab_size} tokens) and a "
                "model without a tokenizer cannot be translated: give both models their tokenizer files")
    conflicts = id_conflicts(draft.tokenizer, target.tokenizer)
    if conflicts == 0:
        return None
    return (f"the draft {draft.name!r} and the target {target.name!r} have different tokenizers "
            f"({conflicts} token ids name different strings)")
