"""Training data for a draft head: corpus windows (the target's own continuations are
head_continuations.py's), the draft vocabulary, and the target's features (head_dataset.py
plans them and caches them on disk).

Per sequence of S tokens the cache holds, for every position t: the target's hidden states at the
head's feature layers (what predicted token t + 1), the target's final normed hidden state (its
logits over the draft vocabulary, the soft labels, are that times the output rows: computed when
training, so the cache stays small), and the target's greedy token (for top-1 agreement). On
disk the hidden states are float8 with a scale per token and layer (~6 KB a token for a 1.5B).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.corpus_files import read_text
from specdec.drafting.head_format import own_network, target_shape
from specdec.models.base import Attention, LanguageModel, Segment
from specdec.training.budget import UNLIMITED, Budget

FIELDS = ("tokens", "features", "final", "greedy")  # HeadFeatures' tensors, in order
# Stored as float8 (e4m3) with a float32 scale per token and hidden-size slice (a target layer):
# half the disk of float16. Measured on the real 1.5B's held-out set (stdlib + site-packages, the
# shipped head): top-1 agreement at depths 1-4 within 0.0007 of float16 features'; soft labels
# from the float8 final state within 0.0005 nats (mean KL) of float16's.
COMPACT = ("features", "final")
FLOAT8_LARGEST = 448.0  # float8_e4m3fn's largest finite value


def to_float8(values: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., k * hidden] -> float8 codes [..., k * hidden] and float32 scales [..., k]: each slice
    of ``hidden`` scaled so its largest magnitude is float8's largest."""
    slices = values.float().unflatten(-1, (-1, hidden))
    scales = slices.abs().amax(-1).clamp(min=1e-12) / FLOAT8_LARGEST
    codes = (slices / scales[..., None]).clamp(-FLOAT8_LARGEST, FLOAT8_LARGEST).to(torch.float8_e4m3fn)
    return codes.flatten(-2), scales


def from_float8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:  # -> float16, codes' shape
    slices = codes.float().unflatten(-1, (scales.shape[-1], -1))
    return (slices * scales[..., None]).flatten(-2).half()


@dataclass
class HeadFeatures:
    """The cached target outputs for N sequences of S tokens."""

    tokens: torch.Tensor  # [N, S] int64
    features: torch.Tensor  # [N, S, len(feature_layers) * hidden] float16
    final: torch.Tensor  # [N, S, hidden] float16: norm(last layer output)
    greedy: torch.Tensor  # [N, S] int64: the target's argmax after each position

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def select(self, rows: torch.Tensor | slice) -> HeadFeatures:
        """These sequences only (an index tensor or a slice)."""
        return HeadFeatures(self.tokens[rows], self.features[rows], self.final[rows], self.greedy[rows])

    @staticmethod
    def cat(parts: Sequence[HeadFeatures]) -> HeadFeatures:
        """The sequences of every part, in order."""
        return HeadFeatures(*(torch.cat([getattr(part, name) for part in parts]) for name in FIELDS))

    def stored(self) -> dict[str, torch.Tensor]:
        """The tensors a saved part holds: COMPACT ones as float8 codes and their ``<name>_scale``."""
        tensors = {"tokens": self.tokens, "greedy": self.greedy}
        for name in COMPACT:
            tensors[name], tensors[f"{name}_scale"] = to_float8(getattr(self, name), self.final.shape[-1])
        return {name: tensor.contiguous() for name, tensor in tensors.items()}

    @staticmethod
    def from_stored(tensors: dict[str, torch.Tensor]) -> HeadFeatures:
        """stored()'s inverse (and float16 parts saved before parts were compact, which have no scales)."""
        def value(name: str) -> torch.Tensor:
            scale = tensors.get(f"{name}_scale")
            return tensors[name] if scale is None else from_float8(tensors[name], scale)

        return HeadFeatures(*(value(name) for name in FIELDS))

    def save(self, path: Path, metadata: dict[str, str] | None = None) -> None:
        """Written whole or not at all; ``metadata``: the file header's (such as a held-out set's
        count of windows)."""
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        save_file(self.stored(), str(partial), metadata=metadata)
        partial.replace(path)

    @staticmethod
    def load(path: Path) -> HeadFeatures:
        from safetensors.torch import load_file

        return HeadFeatures.from_stored(load_file(str(path)))


def corpus_windows(tokenizer, files: Sequence[Path], length: int, max_windows: int) -> list[list[int]]:
    """Non-overlapping windows of ``length`` tokens, a few from each file in turn (variety first)."""
    per_file = []
    for file in files:
        ids = tokenizer(read_text(file), add_special_tokens=False)["input_ids"]
        per_file.append([ids[i : i + length] for i in range(0, len(ids) - length + 1, length)])
        if sum(map(len, per_file)) >= 4 * max_windows:
            break
    windows: list[list[int]] = []
    turn = 0
    while len(windows) < max_windows and any(turn < len(chunks) for chunks in per_file):
        windows.extend(chunks[turn] for chunks in per_file if turn < len(chunks))
        turn += 1
    return windows[:max_windows]


def draft_vocabulary(tokens: torch.Tensor, size: int, vocab_size: int,
                     keep: torch.Tensor | None = None) -> torch.Tensor:  # [size] int64, ascending
    """The ``size`` most frequent of ``tokens`` (any shape, int64; ties: lower id first), as EAGLE-3
    chooses; with ``keep`` (a head's draft vocabulary, widened), those first, then the most
    frequent others up to ``size``."""
    counts = torch.bincount(tokens.flatten(), minlength=vocab_size).tolist()  # one pass: millions of tokens
    size = min(size, vocab_size)
    kept = set() if keep is None else set(keep.tolist())
    order = sorted(range(vocab_size), key=lambda token: (token not in kept, -counts[token], token))
    return torch.tensor(sorted(order[:size]), dtype=torch.long)


def recorded_layers(target: LanguageModel, feature_layers: tuple[int, ...]) -> tuple[int, ...]:
    """The target layers whose outputs a head's data keeps: the feature layers, then the last (its
    normed output gives the soft labels)."""
    return (*feature_layers, target_shape(target).num_layers - 1)


@torch.inference_mode()
def features_from_states(target: LanguageModel, states: torch.Tensor,  # [N, S, layers + 1, hidden]
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # features, final, greedy
    """HeadFeatures' tensors from the target's hidden states at the feature layers and its last
    layer: the features (float16), the final normed state (float16) and the greedy token."""
    network = own_network(target)
    count, length = states.shape[:2]
    features = states[:, :, :-1].reshape(count, length, -1).half().cpu()  # the cache lives on the host
    final = network.norm(states[:, :, -1].to(device=target.device, dtype=target.dtype))
    greedy = torch.stack([network.lm_head(row).argmax(-1).cpu() for row in final])  # a sequence at a time
    return features, final.float().half().cpu(), greedy


def saved_piece(path: Path, make: Callable[[], HeadFeatures | None], budget: Budget,
                where: str) -> tuple[Path | None, bool]:
    """A piece of a head's data (a batch of continuations, a part of windows): (``path`` where a run
    saved it, else made (once ``budget`` allows it: BudgetSpent names ``where``) and saved there, or
    None where ``make`` gave nothing; whether it was made now rather than read back)."""
    if path.exists():
        return path, False
    budget.check(where)
    part = make()
    if part is None:
        return None, True
    part.save(path)
    return path, True


WINDOWS_A_PART = 64  # corpus windows saved together (a multiple of extract_features' batch)

# Told after each piece: (sequences in it, whether it was made now rather than read back), so that a
# progress estimate counts only the time spent making pieces.
PieceProgress = Callable[[int, bool], None]


def window_features(target: LanguageModel, windows: Sequence[Sequence[int]], feature_layers: tuple[int, ...],
                    folder: Path, progress: PieceProgress | None = None, budget: Budget = UNLIMITED,
                    part_size: int | None = None) -> list[Path]:
    """extract_features over ``windows``, ``part_size`` (default WINDOWS_A_PART) at a time, each part a saved_piece in
    ``folder`` (the caller keys the folder by what chose the windows); the parts' paths, in order.
    The parts' batches are the ones a single pass makes (``part_size`` a multiple of the batch), so
    the features are the same bits."""
    part_size = part_size or WINDOWS_A_PART
    paths = []
    for first in range(0, len(windows), part_size):
        chosen = windows[first : first + part_size]
        path, made = saved_piece(folder / f"part-{first:06d}-{len(chosen)}.safetensors",
                                 functools.partial(extract_features, target, chosen, feature_layers),
                                 budget, f"after {first} of {len(windows)} windows")
        assert path is not None, "extract_features always makes a part"
        paths.append(path)
        if progress is not None:
            progress(len(chosen), made)
    return paths


@torch.inference_mode()
def extract_features(target: LanguageModel, windows: Sequence[Sequence[int]], feature_layers: tuple[int, ...],
                     progress: Callable[[int], None] | None = None, batch: int = 4) -> HeadFeatures:
    """One teacher-forced target forward per batch of windows (each in its own cache row)."""
    layers = recorded_layers(target, feature_layers)
    hidden = target_shape(target).hidden_size
    length = len(windows[0])
    tokens = torch.tensor(windows, dtype=torch.long)
    parts = []
    cache = target.new_cache(rows=batch)
    for first in range(0, len(windows), batch):
        rows = range(first, min(first + batch, len(windows)))
        for row in range(batch):
            cache.rollback(row, 0)
        block = tokens[rows.start : rows.stop].reshape(-1).to(target.device)
        positions = torch.arange(length, device=target.device).repeat(len(rows))
        attention = Attention(tuple(Segment(row, length) for row in range(len(rows))), batch_invariant=False)
        output = target.forward(block, positions, cache, attention, want_logits=False, hidden_layers=layers)
        assert output.hidden is not None, "the forward returns the hidden_layers it was asked for"
        states = output.hidden.float().view(len(rows), length, len(layers), hidden)
        parts.append(HeadFeatures(tokens[rows.start : rows.stop], *features_from_states(target, states)))
        if progress is not None:
            progress(len(rows))
    return HeadFeatures.cat(parts)
