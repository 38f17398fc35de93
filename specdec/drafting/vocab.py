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


def shared_token_map(draft_tokenizer: Any, target_tokenizer: Any, draft_rows: int) -> torch.Tensor:  # [draft_rows]
    """For each draft id, the target id of the same token (the same vocabulary string, decoding
    alone to the same text), or -1: the token-level intersection of Timor et al. (ICML 2025)."""
    to_target = torch.full((draft_rows,), -1, dtype=torch.long)
    target_vocab = target_tokenizer.get_vocab()
    for text, draft_id in draft_tokenizer.get_vocab().items():
        target_id = target_vocab.get(text)
        if target_id is not None and draft_id < draft_rows and \
                draft_tokenizer.decode([draft_id]) == target_tokenizer.decode([target_id]):
            to_target[draft_id] = target_id
    return to_target


class LogitsView:
    """A network whose logits pass through ``transform``; everything else is the wrapped one's."""

    def __init__(self, network: Network) -> None:
        self.network = network

    def __getattr__(self, name: str) -> Any:  # the wrapped network's other attributes (config, ...)
        return getattr(self.network, name)

    def new_cache(self, max_length: int, rows: int = 1) -> Cache:
        return self.network.new_cache(max_length, rows)

    def transform(self, logits: torch.Tensor) -> torch.Tensor:  # [n, rows] -> [n, rows']
        raise NotImplementedError

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: Cache, attention: Attention,
                 want_logits: bool = True, hidden_layers: tuple[int, ...] = ()) -> ForwardOutput:
        output = self.network(tokens, positions, cache, attention, want_logits, hidden_layers)
        return output if output.logits is None else ForwardOutput(self.transform(output.logits), output.hidden)


class PaddedLogits(LogitsView):
    """Logits with ``vocab_size`` columns: extra columns cut off, missing ones filled with -inf
    (probability 0). Used for a draft whose embedding is padded to another row count than the
    target's under the same tokenizer: q then ranges over the target's rows, as verification
    expects, and the draft samples from exactly that q (lossless whatever the cut columns held:
    q is still a distribution and the draft draws from it)."""

    def __init__(self, network: Network, vocab_size: int) -> None:
        super().__init__(network)
        self.vocab_size = vocab_size

    def transform(self, logits: torch.Tensor) -> torch.Tensor:  # [n, draft rows] -> [n, vocab_size]
        if logits.shape[-1] >= self.vocab_size:
            return logits[:, : self.vocab_size]
        resized = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        resized[:, : logits.shape[-1]] = logits
        return resized


class SharedLogits(LogitsView):
    """Logits of the tokens that ``allowed`` marks, -inf elsewhere: a draft that samples only
    tokens the target's vocabulary also has (token-level intersection)."""

    def __init__(self, network: Network, allowed: torch.Tensor) -> None:  # allowed [rows] bool
        super().__init__(network)
        self.allowed = allowed

    def transform(self, logits: torch.Tensor) -> torch.Tensor:  # [n, rows]
        return logits.masked_fill(~self.allowed.to(logits.device), float("-inf"))


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
