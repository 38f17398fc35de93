"""What a head trains on, prepared once: the plan (corpus windows, the target's continuations,
held-out sets, the draft vocabulary) and its cache on disk, keyed by the plan."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.corpus_files import collect_files, standard_library
from specdec.models.base import LanguageModel
from specdec.training.data import split_files
from specdec.training.head_continuations import continuation_features
from specdec.training.head_data import HeadFeatures, corpus_windows, draft_vocabulary, extract_features


@dataclass(frozen=True)
class DataPlan:
    data: tuple[str, ...]  # files or folders ("" = the standard library)
    sequence_length: int
    corpus_sequences: int
    continuation_sequences: int
    heldout_sequences: int
    draft_vocab: int
    feature_layers: tuple[int, ...]
    target: str  # the target's name and precision: a cache is valid for one target only
    continuation_start: int = 0  # the training continuations' first prompt (held-out ones start at 0)
    # The file list's rule: another rule gives other prompts under the same numbers (cache keys).
    corpus_rule: str = "suite quotes left out"

    def key(self, *fields: str) -> str:
        """A short hash of these fields (all when none are named)."""
        chosen = {name: self.__dict__[name] for name in fields} if fields else self.__dict__
        return hashlib.sha1(json.dumps(chosen, sort_keys=True, default=str).encode()).hexdigest()[:12]


def prepare(target: LanguageModel, plan: DataPlan, cache_dir: Path, say: Callable[[str], None],
            progress_bar: Callable[[str, int], Callable[[int], None]],
            ) -> tuple[HeadFeatures, HeadFeatures, torch.Tensor]:
    """(train features, held-out features, draft vocabulary), from the cache when present."""
    folder = cache_dir / plan.key()
    paths = [folder / name for name in ("train.safetensors", "heldout.safetensors", "draft_vocab.json")]
    if all(path.exists() for path in paths):
        say(f"target features from the cache: {folder}")
        vocabulary = torch.tensor(json.loads(paths[2].read_text()), dtype=torch.long)
        return HeadFeatures.load(paths[0]), HeadFeatures.load(paths[1]), vocabulary
    files = collect_files([Path(p) for p in plan.data] if plan.data else standard_library())
    train_files, heldout_files = split_files(files, 0.05)
    length = plan.sequence_length
    windows = corpus_windows(target.tokenizer, train_files, length, plan.corpus_sequences)
    heldout = corpus_windows(target.tokenizer, heldout_files, length, plan.heldout_sequences)
    if not (windows or plan.continuation_sequences) or not heldout:
        raise ValueError(
            f"the data gives no {length}-token sequences to train on (or none held out): "
            "give more files with --data, or a shorter --sequence-length"
        )
    train_parts: list[HeadFeatures] = []
    held_parts: list[HeadFeatures] = []
    # Continuations first: a start past the data's prompts fails before minutes of corpus features.
    if plan.continuation_sequences:  # held out: as many continuations of held-out files as corpus windows
        # Not keyed by the counts: the first N prompts are the same for any larger count, so a run
        # asking for more continuations (or fewer) reuses every batch generated before.
        prompts_key = plan.key("data", "sequence_length", "feature_layers", "target", "corpus_rule")
        generated = cache_dir / f"continuations-{prompts_key}"
        for parts, source, start, count, name in (
                (train_parts, train_files, plan.continuation_start, plan.continuation_sequences, "continuations"),
                (held_parts, heldout_files, 0, len(heldout), "heldout-continuations")):
            continued = continuation_features(target, source, length, count, plan.feature_layers, generated / name,
                                              progress_bar(f"target {name}", count), start=start, say=say)
            if continued is not None:
                parts.append(continued)
    for parts, chosen, name in ((train_parts, windows, "target features"), (held_parts, heldout, "held-out features")):
        if chosen:  # corpus windows ahead of continuations, as the cache has always held them
            parts.insert(0, extract_features(target, chosen, plan.feature_layers, progress_bar(name, len(chosen))))
    if not train_parts:
        raise ValueError("the target stopped (EOS) before every continuation reached --sequence-length tokens")
    train, held = HeadFeatures.cat(train_parts), HeadFeatures.cat(held_parts)
    vocabulary = draft_vocabulary(train.tokens.tolist(), plan.draft_vocab, target.vocab_size)
    train.save(paths[0])
    held.save(paths[1])
    paths[2].write_text(json.dumps(vocabulary.tolist()))
    return train, held, vocabulary
