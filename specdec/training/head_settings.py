"""What `specdec train-head` is asked to do: one small dataclass, read by the command's parser (which
must not import torch) and by the training (specdec.training.head_train)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadTraining:
    out: str
    data: tuple[str, ...] = ()
    draft_vocab: int = 8192
    steps: int = 2000
    ttt_steps: int = 3
    sequence_length: int = 256
    corpus_sequences: int = 400
    continuation_sequences: int = 0
    continuation_start: int = 0  # skip the first prompts (those an --init-head was trained on)
    heldout_sequences: int = 16
    batch_size: int = 8
    learning_rate: float = 1e-3
    intermediate_size: int | None = None
    init_head: str | None = None  # a saved head to go on from (its vocabulary and shape), e.g. on new data
    precision: str = "auto"  # the head's matmuls while training: float32, bfloat16 (autocast) or auto
    eval_every: int = 200
    checkpoint_every: int = 100
    seed: int = 0
    # Make and train on only the first N windows / continuations' prompts of the plan (whole saved
    # parts, the ones the whole plan reads; None: all): a learning curve's points.
    train_windows: int | None = None
    train_continuations: int | None = None
    hours: float | None = None  # this run's budget: it stops (all saved) when spent; the same command goes on
    command: str = ""
