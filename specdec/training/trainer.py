"""Training loops for `specdec train`: a target from data, a draft distilled from the target.

Models are transformers' LlamaForCausalLM, so what is saved is a plain Hugging Face folder that
both specdec and transformers load. The draft learns the target's soft labels (forward KL on
the training text, as in DistillSpec), which is what raises acceptance, not the data's labels.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from specdec.training.data import TokenWindows


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int

    def llama_config(self, vocab_size: int, max_positions: int, tokenizer):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, max_position_embeddings=max_positions,
            tie_word_embeddings=True, rms_norm_eps=1e-5,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )


@dataclass
class TrainPlan:
    name: str  # "target" or "draft"
    steps: int | None = None  # fixed number of steps, or
    minutes: float | None = None  # a wall-clock budget, turned into steps after a timed start
    learning_rate: float = 2e-3
    weight_decay: float = 0.1
    eval_every: int = 200
    eval_windows: int = 64
    checkpoint_every: int = 100

    def __post_init__(self) -> None:
        if (self.steps is None) == (self.minutes is None):
            raise ValueError(f"{self.name}: give exactly one of steps or minutes")


@dataclass
class History:
    steps: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)
    eval_agreement: list[float] = field(default_factory=list)  # draft only: top-1 agreement with the target
    tokens_per_second: float = 0.0
    total_steps: int = 0
    seconds: float = 0.0


def learning_rate(step: int, total: int, peak: float) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    warmup = max(1, min(100, total // 20))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def distillation_loss(
    student_logits: torch.Tensor,  # [batch, seq, vocab]
    teacher_logits: torch.Tensor,  # [batch, seq, vocab]
) -> torch.Tensor:
    """Forward KL(p_target || q_draft), averaged over tokens."""
    teacher_log_probs = teacher_logits.float().log_softmax(-1)
    student_log_probs = student_logits.float().log_softmax(-1)
    return (teacher_log_probs.exp() * (teacher_log_probs - student_log_probs)).sum(-1).mean()


@torch.no_grad()
def evaluate(model, windows: TokenWindows, max_windows: int, teacher=None) -> tuple[float, float | None]:
    """Held-out cross-entropy (nats per token) and, with a teacher, top-1 agreement with it."""
    model.eval()
    losses, agreements = [], []
    for batch in windows.sequential(max_windows):
        logits = model(input_ids=batch[:, :-1]).logits
        losses.append(F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten()).item())
        if teacher is not None:
            teacher_logits = teacher(input_ids=batch[:, :-1]).logits
            agreements.append((logits.argmax(-1) == teacher_logits.argmax(-1)).float().mean().item())
    model.train()
    return sum(losses) / len(losses), (sum(agreements) / len(agreements) if agreements else None)


class Trainer:
    """One model's training run, resumable from its checkpoint file."""

    def __init__(self, model, train: TokenWindows, heldout: TokenWindows, plan: TrainPlan,
                 checkpoint_path: Path, teacher=None) -> None:
        self.model, self.train_windows, self.heldout, self.plan = model, train, heldout, plan
        self.checkpoint_path, self.teacher = checkpoint_path, teacher
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": plan.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=plan.learning_rate, betas=(0.9, 0.95),
        )
        self.step = 0
        self.history = History(total_steps=plan.steps or 0)

    def save_checkpoint(self) -> None:
        state = {
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
            "history": asdict(self.history), "data_rng": self.train_windows.generator.get_state(),
            "plan": asdict(self.plan),
        }
        partial = self.checkpoint_path.with_suffix(".partial")
        torch.save(state, partial)
        os.replace(partial, self.checkpoint_path)  # atomic: a crash never leaves half a checkpoint

    def load_checkpoint(self) -> bool:
        if not self.checkpoint_path.is_file():
            return False
        state = torch.load(self.checkpoint_path, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        self.history = History(**state["history"])
        self.train_windows.generator.set_state(state["data_rng"])
        return True

    def loss(self, batch: torch.Tensor) -> torch.Tensor:  # batch [B, T + 1]
        inputs, labels = batch[:, :-1], batch[:, 1:]
        logits = self.model(input_ids=inputs).logits
        if self.teacher is None:
            return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        with torch.no_grad():
            teacher_logits = self.teacher(input_ids=inputs).logits
        return distillation_loss(logits, teacher_logits)

    def run(self, progress: Progress | None = None) -> History:
        plan, history = self.plan, self.history
        tokens_per_step = self.train_windows.batch_size * self.train_windows.seq_len
        self.model.train()
        started, timed_from = time.perf_counter(), None
        budget_seconds = plan.minutes * 60 if plan.minutes else None
        spent_before = history.seconds
        task = progress.add_task(plan.name, total=history.total_steps or None, loss=float("nan"), rate=0.0) \
            if progress else None
        while history.total_steps == 0 or self.step < history.total_steps:
            for group in self.optimizer.param_groups:
                group["lr"] = learning_rate(self.step, history.total_steps or 10**9, plan.learning_rate)
            loss = self.loss(self.train_windows.next_batch())
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.step += 1
            history.steps.append(self.step)
            history.train_loss.append(loss.item())
            elapsed = time.perf_counter() - started
            history.seconds = spent_before + elapsed
            if self.step == 2:
                timed_from = (time.perf_counter(), self.step)
            if budget_seconds and history.total_steps == 0 and self.step == 12 and timed_from is not None:
                # Steps 3..12 time a step; the budget (less ~8% for evaluations) fixes the schedule.
                seconds_per_step = (time.perf_counter() - timed_from[0]) / (self.step - timed_from[1])
                history.total_steps = max(self.step + 1, int(0.92 * budget_seconds / seconds_per_step))
                if progress is not None and task is not None:
                    progress.update(task, total=history.total_steps)
            if timed_from and self.step > timed_from[1]:
                history.tokens_per_second = tokens_per_step * (self.step - timed_from[1]) / \
                    (time.perf_counter() - timed_from[0])
            if self.step % plan.eval_every == 0 or self.step == history.total_steps:
                eval_loss, agreement = evaluate(self.model, self.heldout, plan.eval_windows, self.teacher)
                history.eval_steps.append(self.step)
                history.eval_loss.append(eval_loss)
                if agreement is not None:
                    history.eval_agreement.append(agreement)
            if self.step % plan.checkpoint_every == 0 or self.step == history.total_steps:
                self.save_checkpoint()
            if progress is not None and task is not None:
                progress.update(task, completed=self.step, loss=loss.item(), rate=history.tokens_per_second)
        return history


def progress_bar() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
        TextColumn("loss {task.fields[loss]:.3f}"), TextColumn("{task.fields[rate]:.0f} tok/s"),
        TimeElapsedColumn(), TimeRemainingColumn(),
    )


def plot_losses(histories: dict[str, History], tokens_per_step: dict[str, int], path: Path) -> None:
    """Training loss (smoothed) and held-out loss against tokens seen, one line per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.5))
    for name, history in histories.items():
        if not history.steps:
            continue
        scale = tokens_per_step[name] / 1e6
        window = max(1, len(history.train_loss) // 50)
        smoothed = torch.tensor(history.train_loss).unfold(0, window, 1).mean(-1) if len(history.train_loss) >= window \
            else torch.tensor(history.train_loss)
        steps = history.steps[window - 1 :] if len(history.train_loss) >= window else history.steps
        label = "KL to target" if name == "draft" else "cross-entropy"
        line, = axis.plot([s * scale for s in steps], smoothed.tolist(), label=f"{name} train ({label})")
        axis.plot([s * scale for s in history.eval_steps], history.eval_loss, "o--", color=line.get_color(),
                  label=f"{name} held-out cross-entropy")
    axis.set_xlabel("training tokens (millions)")
    axis.set_ylabel("loss (nats per token)")
    axis.set_title("specdec train: loss curves")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
