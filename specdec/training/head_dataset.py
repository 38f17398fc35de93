"""What a head trains on, prepared once: the plan (corpus windows, the target's continuations,
held-out sets, the draft vocabulary) and its cache on disk, keyed by the plan."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.corpus_files import training_files
from specdec.models.base import LanguageModel
from specdec.training.budget import UNLIMITED, Budget
from specdec.training.data import split_files
from specdec.training.feature_parts import FeatureParts
from specdec.training.head_continuations import CONTINUATIONS_A_BATCH, continuation_features
from specdec.training.head_data import (
    WINDOWS_A_PART,
    HeadFeatures,
    PieceProgress,
    corpus_windows,
    draft_vocabulary,
    window_features,
)
from specdec.training.head_prompts import PROMPT_RULE


@dataclass(frozen=True)
class DataPlan:
    data: tuple[str, ...]  # files, folders, or the sources named in corpus_files.SOURCES (none: the standard library)
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
    prompt_rule: str = PROMPT_RULE  # the continuations' prompts (head_prompts)

    def key(self, *fields: str) -> str:
        """A short hash of these fields (all when none are named)."""
        chosen = {name: self.__dict__[name] for name in fields} if fields else self.__dict__
        return hashlib.sha1(json.dumps(chosen, sort_keys=True, default=str).encode()).hexdigest()[:12]


def prepare(target: LanguageModel, plan: DataPlan, cache_dir: Path, say: Callable[[str], None],
            progress_bar: Callable[[str, int], PieceProgress], budget: Budget = UNLIMITED,
            train_on: tuple[int | None, int | None] = (None, None),
            ) -> tuple[FeatureParts, HeadFeatures, torch.Tensor]:
    """(train features, held-out features, draft vocabulary). Every piece (a batch of continuations,
    a part of windows) is saved under ``cache_dir`` when done and read back by a later run; the
    ``budget`` is checked before each piece not yet saved (BudgetSpent once it is used up). The
    training features stay in their parts on disk (FeatureParts: read a batch at a time); the
    held-out set, small, is read whole. ``train_on``: only the first (windows, continuations' prompts)
    of the plan are made and trained on, in whole parts (None: all); they are the same parts a run
    of the whole plan makes and reads, so a learning curve's points can be trained while the rest is
    still to be made. The draft vocabulary is counted over the training data trained on."""
    folder = cache_dir / plan.key()
    files = training_files(plan.data)
    train_files, heldout_files = split_files(files, 0.05)
    length = plan.sequence_length
    windows = corpus_windows(target.tokenizer, train_files, length, plan.corpus_sequences)
    heldout = corpus_windows(target.tokenizer, heldout_files, length, plan.heldout_sequences)
    if not (windows or plan.continuation_sequences) or not heldout:
        raise ValueError(
            f"the data gives no {length}-token sequences to train on (or none held out): "
            "give more files with --data, or a shorter --sequence-length"
        )
    # Continuations are not keyed by their counts: the first N prompts are the same for any larger
    # count, so a run asking for more continuations (or fewer) reuses every batch generated before.
    prompts_key = plan.key("data", "sequence_length", "feature_layers", "target", "corpus_rule", "prompt_rule")
    # Windows are keyed by everything that chooses them (a larger count takes others from each file).
    windows_key = plan.key("data", "sequence_length", "corpus_sequences", "heldout_sequences", "feature_layers",
                           "target", "corpus_rule")

    def continued(source: list[Path], start: int, count: int, name: str) -> list[Path]:
        if not count:
            return []
        return continuation_features(target, source, length, count, plan.feature_layers,
                                     cache_dir / f"continuations-{prompts_key}" / name,
                                     progress_bar(f"target {name}", count), start=start, say=say, budget=budget)

    def windowed(chosen: list[list[int]], name: str, label: str) -> list[Path]:
        return window_features(target, chosen, plan.feature_layers, cache_dir / f"{name}-{windows_key}",
                               progress_bar(label, len(chosen)), budget) if chosen else []

    # The held-out pieces first (as many continuations of held-out files as held-out windows), so
    # that a run its budget stops early can already be measured on them; then the training
    # windows, then the continuations. Each set holds its windows ahead of its continuations.
    held_continued = continued(heldout_files, 0, len(heldout) if plan.continuation_sequences else 0,
                               "heldout-continuations")
    held_parts = windowed(heldout, "heldout-windows", "held-out features") + held_continued
    window_parts = windowed(windows[: share(len(windows), train_on[0], WINDOWS_A_PART)], "windows", "target features")
    train_parts = window_parts + continued(
        train_files, plan.continuation_start,
        share(plan.continuation_sequences, train_on[1], CONTINUATIONS_A_BATCH), "continuations")
    if not train_parts:
        raise ValueError("the target stopped (EOS) before every continuation reached --sequence-length tokens")
    train, held = FeatureParts(train_parts), FeatureParts(held_parts).whole()
    vocabulary = draft_vocabulary(train.tokens, plan.draft_vocab, target.vocab_size)
    # What benchmarks/cpu/head_heldout.py reads; its windows come first (continuations may be fewer:
    # those that stopped early are left out).
    held.save(folder / "heldout.safetensors", {"windows": str(len(heldout))})
    (folder / "draft_vocab.json").write_text(json.dumps(vocabulary.tolist()))
    say(f"features: {len(train)} training sequences ({train.tokens.numel():,} tokens), {len(held)} held out; "
        f"{disk_use(cache_dir) / 1e9:.2f} GB on disk in {cache_dir}")
    return train, held, vocabulary


def share(count: int, limit: int | None, piece: int) -> int:
    """The first ``limit`` of ``count`` (None: all), rounded up to whole pieces of ``piece``."""
    return count if limit is None else min(count, -(-limit // piece) * piece)


def disk_use(folder: Path) -> int:
    """Bytes of every file under ``folder``."""
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
