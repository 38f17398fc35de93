"""The target's own continuations of code prompts, with its features recorded while it writes them.

EAGLE trains its heads on the target's own responses: that is the text a head drafts against.
Generating them is the slow part of the data on a CPU, so the generation itself records what
training needs: a drafter that drafts nothing (``FeatureRecorder``) asks the engine for the
target's hidden states at the head's feature layers and the last layer, which every prefill and
step forward returns anyway. No second, teacher-forced pass over the text. Batches are saved as
they finish, so an interrupted run goes on from the last whole batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from specdec.core.drafts import BaseDrafter, Draft, DraftRequest, StepOutcome
from specdec.models.base import LanguageModel
from specdec.text import chat_prompt_ids
from specdec.training.budget import UNLIMITED, Budget
from specdec.training.head_data import (
    HeadFeatures,
    PieceProgress,
    features_from_states,
    recorded_layers,
    saved_piece,
)
from specdec.training.head_prompts import HeadPrompt, head_prompts


class FeatureRecorder(BaseDrafter):
    """Drafts nothing; keeps, per request, the target's hidden states at ``hidden_layers`` of every
    position the engine runs (the prompt's from its prefill, then one per emitted token)."""

    def __init__(self, hidden_layers: tuple[int, ...]) -> None:
        self.hidden_layers = hidden_layers
        self.records: list[tuple[list[int], list[torch.Tensor]]] = []  # (prompt ids, [rows, layers * hidden] pieces)

    def start(self, prompt_ids: torch.Tensor) -> list[torch.Tensor]:
        pieces: list[torch.Tensor] = []
        self.records.append((prompt_ids.tolist(), pieces))
        return pieces

    def prefilled(self, request: DraftRequest, hidden: torch.Tensor) -> None:  # [prompt - 1, layers * hidden]
        request.draft_state.append(hidden.float().cpu())

    def observe(self, request: DraftRequest, outcome: StepOutcome) -> None:  # hidden [emitted, layers * hidden]
        if outcome.hidden is not None:
            request.draft_state.append(outcome.hidden.float().cpu())

    def propose(self, request: DraftRequest, gamma: int) -> Draft:
        return Draft.empty(request.context.device)


def record_continuations(target: LanguageModel, prompts: Sequence[Sequence[int]], length: int,
                         feature_layers: tuple[int, ...]) -> HeadFeatures | None:
    """Greedy continuations of ``prompts`` (one batch) to ``length`` tokens, with the target's
    features at every position; those that stop early (EOS) are left out. None when all do."""
    from specdec.core.sampling import SamplingParams
    from specdec.decoder import SpeculativeDecoder

    layers = recorded_layers(target, feature_layers)
    recorder = FeatureRecorder(layers)
    decoder = SpeculativeDecoder(target, recorder)
    # One token past the window: its step forward runs the window's last position.
    settings = [SamplingParams(max_new_tokens=length + 1 - len(prompt)) for prompt in prompts]
    results = decoder.generate([list(prompt) for prompt in prompts], settings)
    assert isinstance(results, list)  # a list of prompts gives a list of results
    windows, states = [], []
    for prompt, result, (recorded_prompt, pieces) in zip(prompts, results, recorder.records, strict=True):
        if recorded_prompt != list(prompt):
            raise RuntimeError("the engine started its requests out of order")
        sequence = list(prompt) + result.token_ids
        if len(sequence) < length + 1:  # stopped at EOS: too short to train on unpadded
            continue
        rows = torch.cat(pieces)[:length]  # [length, layers * hidden]: positions 0 .. length - 1
        windows.append(sequence[:length])
        states.append(rows.view(length, len(layers), -1))
    if not windows:
        return None
    features, final, greedy = features_from_states(target, torch.stack(states))
    return HeadFeatures(torch.tensor(windows, dtype=torch.long), features, final, greedy)


CONTINUATIONS_A_BATCH = 32  # prompts generated and saved together


def prompt_ids(tokenizer, prompt: HeadPrompt) -> list[int]:
    """A prompt's token ids: a chat request through the target's chat template, else the text."""
    if prompt.kind == "chat":
        return chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt.request}])
    return tokenizer(prompt.text, add_special_tokens=False)["input_ids"]


def continuation_features(target: LanguageModel, files: Sequence[Path], length: int, count: int,
                          feature_layers: tuple[int, ...], folder: Path,
                          progress: PieceProgress | None = None, batch: int = CONTINUATIONS_A_BATCH,
                          start: int = 0, say: Callable[[str], None] | None = None,
                          budget: Budget = UNLIMITED) -> list[Path]:
    """Up to ``count`` continuations of prompts from ``files`` (head_prompts: completions, docstrings,
    class bodies, chat requests; at most half the window, its end kept), from prompt ``start`` on,
    with their features: the paths of the saved batches, in order. Each batch is saved in
    ``folder`` when done and read back from there on a later run (head_prompts' first N prompts are
    the same for any larger count: a run that asks for more reuses these).
    The data gives a limited number of prompts (two per file): none from ``start`` on is an error
    (the run would train on corpus windows alone), fewer than ``count`` is told through ``say``.
    ``budget``: checked before each batch not yet saved (BudgetSpent once spent)."""
    available = head_prompts(files, start + count)
    if count and len(available) <= start:
        raise ValueError(f"--continuation-start {start}: the data gives {len(available)} prompts (two per file), "
                         "none from there on; give more files with --data, or a smaller --continuation-start")
    if len(available) < start + count and say is not None:
        say(f"continuations: prompts {start}-{len(available) - 1}, the last the data gives ({len(available) - start} "
            f"of the {count} asked for)")
    prompts = [prompt_ids(target.tokenizer, prompt)[-(length // 2):] for prompt in available[start:]]
    paths = []
    for first in range(start, start + len(prompts), batch):
        group = prompts[first - start : first - start + batch]
        # A short last batch is its own part.
        path, made = saved_piece(folder / f"part-{first:06d}-{len(group)}.safetensors",
                                 functools.partial(record_continuations, target, group, length, feature_layers),
                                 budget, f"after {first - start} of {len(prompts)} continuations")
        if path is not None:  # a batch whose every continuation stopped early saves nothing
            paths.append(path)
        if progress is not None:
            progress(len(group), made)
    return paths
