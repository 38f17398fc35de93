"""Training an EAGLE-3 head (`specdec train-head`'s work): features of the target, the
training-time-test loop with checkpoints and progress, the saved folder and its model card."""

from __future__ import annotations

import functools
import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from specdec.drafting.head import DraftHead, default_feature_layers
from specdec.drafting.head_finder import target_identity, write_identity
from specdec.drafting.head_format import load_head, new_head, save_head, target_shape, widened_head
from specdec.machine import has_fast_bfloat16, isa_summary
from specdec.training.budget import Budget
from specdec.training.head_data import PieceProgress, draft_vocabulary
from specdec.training.head_dataset import DataPlan
from specdec.training.head_settings import HeadTraining


def progress_bar(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


class PiecePace:
    """How long the rest of ``total`` units (sequences, steps) takes at the pace of the pieces made
    in this run (pieces read back from an earlier run take no time and are left out of the pace)."""

    def __init__(self, total: int, unit: str = "sequence", clock: Callable[[], float] = time.perf_counter) -> None:
        self.total, self.unit, self.clock = total, unit, clock
        self.done = self.made = 0
        self.making_seconds = 0.0
        self.last = clock()

    def told(self, count: int, made: bool) -> str:
        """Counts a piece of ``count`` units; what is left, in words ('' before one was made)."""
        now = self.clock()
        self.done += count
        if made:
            self.made += count
            self.making_seconds += now - self.last
        self.last = now
        if not self.made or self.done >= self.total:
            return ""
        seconds = (self.total - self.done) * self.making_seconds / self.made
        left = f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"
        return f"{left} left at this run's {self.making_seconds / self.made:.2f} s a {self.unit}"


def train_head(target, settings: HeadTraining, console: Console | None = None) -> Path:
    """Train (or resume) a head for ``target``; returns the saved EAGLE-3 folder. Raises BudgetSpent
    when ``settings.hours`` run out first (the data generated and the last step saved: the same
    settings go on from there)."""
    from specdec.training.head_dataset import prepare
    from specdec.training.head_trainer import evaluate, learning_rate, sample_batch, unrolled_loss

    console = console or Console(stderr=True)
    out = Path(settings.out)
    plan = data_plan(target, settings)
    layers = plan.feature_layers
    started = time.perf_counter()
    budget = Budget(settings.hours)
    with progress_bar(console) as progress:

        def bar(label: str, total: int) -> PieceProgress:
            task = progress.add_task(label, total=total, info="")
            pace = PiecePace(total)

            def advance(count: int, made: bool) -> None:
                before = progress.tasks[task].completed
                progress.advance(task, count)
                if not made:  # read back: the bar's own estimate starts again from here
                    progress.reset(task, completed=int(before + count))
                    progress.update(task)  # finished again where it is complete (reset clears that)
                left = pace.told(count, made)
                if not console.is_terminal and int(10 * (before + count) / total) > int(10 * before / total):
                    # a log gets a line per tenth
                    console.print(f"{label}: {int(before + count)}/{total}" + (f", {left}" if left else ""))

            return advance

        train, heldout, vocabulary = prepare(target, plan, out / "features", console.print, bar, budget,
                                             (settings.train_windows, settings.train_continuations))
        torch.manual_seed(settings.seed)
        head, widened_from = initial_head(target, settings, vocabulary, layers, train.tokens)
        head = head.float().train()
        device = head.fc.weight.device
        output_rows = target_output_rows(target)[head.draft_token_ids.cpu()].to(device)  # [draft_vocab, hidden]
        trainable = [p for p in head.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=settings.learning_rate, weight_decay=0.0)
        generator = torch.Generator().manual_seed(settings.seed)
        matmuls = training_dtype(settings.precision, device)  # the head's weights stay float32 (autocast)
        autocast = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16,
                                     enabled=matmuls == torch.bfloat16)
        step, history = resume(out, head, optimizer, generator, settings, console)
        task = progress.add_task("head", total=settings.steps, completed=step, info="")
        pace = PiecePace(settings.steps, "step")
        pace.told(step, made=False)  # the steps of earlier runs
        while step < settings.steps:
            budget.check(f"at step {step} of {settings.steps} (checkpoint saved)", functools.partial(
                save_checkpoint, out, head, optimizer, generator, step, history, settings))
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, settings.steps, settings.learning_rate)
            # Drawn outside autocast: its torch.cat of float16 parts fails inside it.
            batch = sample_batch(train, settings.batch_size, generator)
            with autocast():
                result = unrolled_loss(head, batch, output_rows, settings.ttt_steps)
            optimizer.zero_grad(set_to_none=True)
            result.loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 0.5)
            optimizer.step()
            step += 1
            left = pace.told(1, made=True)
            info = f"loss {float(result.loss.detach()):.3f} top-1 " + " ".join(f"{a:.2f}" for a in result.agreement)
            if step % settings.eval_every == 0 or step == settings.steps:
                with autocast():
                    held = evaluate(head, heldout, output_rows, settings.ttt_steps)
                history.append(
                    {
                        "step": step,
                        "heldout_loss": round(float(held.loss), 4),
                        "heldout_top1": [round(a, 4) for a in held.agreement],
                    }
                )
                info += " | held-out " + " ".join(f"{a:.2f}" for a in held.agreement)
                progress.console.print(f"step {step}: {info}" + (f" ({left})" if left else ""), highlight=False)
            progress.update(task, completed=step, info=info)
            if step % settings.checkpoint_every == 0 or step == settings.steps:
                save_checkpoint(out, head, optimizer, generator, step, history, settings)
    hours = (time.perf_counter() - started) / 3600
    card = model_card(target, settings, history, hours, len(train), plan, str(matmuls).removeprefix("torch."),
                      widened_from)
    folder = save_head(head.eval(), out / "head", card, dtype=torch.bfloat16)
    # The model card's facts for programs (benchmarks/cpu/head_curve.py): what it was trained on.
    (folder / "training.json").write_text(json.dumps({
        "sequences": len(train), "tokens": int(train.tokens.numel()), "steps": settings.steps,
        "hours_this_run": round(hours, 4), "history": history}, indent=1))
    identity = target_identity(target)
    if identity is not None:  # so that `auto` finds the head for this target by itself
        write_identity(folder, identity)
    return folder


def data_plan(target, settings: HeadTraining) -> DataPlan:
    """What the data of ``settings`` is for ``target`` (its cache key: heldout.safetensors lies in
    ``--out/features/<plan.key()>``)."""
    return DataPlan(
        settings.data,
        settings.sequence_length,
        settings.corpus_sequences,
        settings.continuation_sequences,
        settings.heldout_sequences,
        settings.draft_vocab,
        default_feature_layers(target_shape(target).num_layers),
        f"{target.name}:{target.precision}:{target.path}",  # int8 and float32 targets share a dtype
        settings.continuation_start,
    )


def initial_head(target, settings: HeadTraining, vocabulary: torch.Tensor, layers: tuple[int, ...],
                 tokens: torch.Tensor) -> tuple[DraftHead, int | None]:  # tokens: the training data's, any shape
    """(head, the draft vocabulary's size before widening, if it was widened). A new head over
    ``vocabulary`` (the data's most frequent tokens), or the saved one of ``--init-head`` (its own
    sizes: training goes on from its weights), over its own draft vocabulary or, where
    ``--draft-vocab`` asks for more tokens, that widened with the data's most frequent others
    (widened_head)."""
    if settings.init_head is None:
        return new_head(target, vocabulary, settings.intermediate_size, layers), None
    head = load_head(settings.init_head, target)
    if head.config.feature_layers != layers:
        raise ValueError(f"the head at {settings.init_head} reads target layers {head.config.feature_layers}; "
                         f"the features computed here are of layers {layers}")
    size = head.config.draft_vocab_size
    if settings.draft_vocab <= size:
        return head, None
    return widened_head(head, draft_vocabulary(tokens, settings.draft_vocab, target.vocab_size,
                                               keep=head.draft_token_ids)), size


def training_dtype(precision: str, device: torch.device) -> torch.dtype:
    """bfloat16 where asked, or with ``auto`` where the hardware multiplies bfloat16; else float32."""
    if precision not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"precision must be auto, float32 or bfloat16, not {precision!r}")
    fast = device.type == "cuda" or has_fast_bfloat16()
    return torch.bfloat16 if precision == "bfloat16" or (precision == "auto" and fast) else torch.float32


@torch.inference_mode()
def target_output_rows(target) -> torch.Tensor:  # [vocab, hidden] float32
    """The target's output head as a matrix, whatever its linear (float or int8): its outputs for
    the unit vectors (an int8 head quantizes each unit row exactly)."""
    hidden = target_shape(target).hidden_size
    unit = torch.eye(hidden, dtype=target.dtype, device=target.device)
    return target.network.lm_head(unit).float().T.contiguous().cpu()


def save_checkpoint(out: Path, head, optimizer, generator, step: int, history: list, settings: HeadTraining) -> None:
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "checkpoint.partial"
    torch.save(
        {
            "head": head.state_dict(),
            "optimizer": optimizer.state_dict(),
            "generator": generator.get_state(),
            "step": step,
            "history": history,
            "settings": training_identity(settings),
        },
        partial,
    )
    partial.replace(out / "checkpoint.pt")  # a crash mid-write leaves the last whole checkpoint


def training_identity(settings: HeadTraining) -> dict:
    """What must match for a checkpoint to be resumed (not the step budget, the command, or the
    matmuls' precision: a run may go on on other hardware)."""
    return {
        key: value
        for key, value in asdict(settings).items()
        if key not in ("steps", "command", "eval_every", "checkpoint_every", "precision", "hours")
    }


def resume(out: Path, head, optimizer, generator, settings: HeadTraining, console: Console) -> tuple[int, list]:
    path = out / "checkpoint.pt"
    if not path.exists():
        return 0, []
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state["settings"] != training_identity(settings):
        raise ValueError(
            f"{path} was trained with other settings ({state['settings']}); use another --out or the same settings"
        )
    head.load_state_dict(state["head"])
    optimizer.load_state_dict(state["optimizer"])
    generator.set_state(state["generator"])
    console.print(f"resumed from {path} at step {state['step']}")
    return state["step"], state["history"]


def head_from_checkpoint(target, path: str | Path) -> DraftHead:
    """The head a run's checkpoint holds (``--out/checkpoint.pt``, written every
    ``--checkpoint-every`` steps), in float32: to score a run before it ends."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    weights, init = state["head"], state["settings"]["init_head"]
    draft_token_ids = torch.arange(weights["d2t"].numel()) + weights["d2t"]  # target id = draft id + d2t
    if init is None:
        head = new_head(target, draft_token_ids, weights["midlayer.down_proj.weight"].shape[1],
                        default_feature_layers(target_shape(target).num_layers))
    else:
        head = load_head(init, target)
        if head.config.draft_vocab_size != draft_token_ids.numel():
            head = widened_head(head, draft_token_ids)
    head.load_state_dict(weights)
    return head.float()


def model_card(target, settings: HeadTraining, history: list, hours: float, sequences: int, plan,
               matmul_dtype: str, widened_from: int | None) -> str:
    last = history[-1] if history else {}
    agreement = ", ".join(f"depth {i + 1}: {a:.3f}" for i, a in enumerate(last.get("heldout_top1", [])))
    data = ", ".join(settings.data) or "Python's standard library (this machine's)"
    return "\n".join(
        [
            f"# EAGLE-3 draft head for {target.name}",
            "",
            "Trained with specdec's `train-head`; loads with `--drafter head-tree --draft-head DIR`.",
            "",
            f"- command: `{settings.command}`",
            f"- target: {target.name} ({target.precision}, {target.path}); feature layers {plan.feature_layers}",
            f"- data: {data}; {sequences} training sequences of {settings.sequence_length} tokens "
            f"({settings.corpus_sequences} corpus windows requested, "
            f"{settings.continuation_sequences} target continuations"
            + (f" of prompts {settings.continuation_start} on)" if settings.continuation_start else ")"),
            f"- draft vocabulary: {settings.draft_vocab} most frequent tokens; MLP width "
            f"{settings.intermediate_size or 'the target’s'}" if settings.init_head is None else
            f"- started from the head at {settings.init_head} (its sizes; its draft vocabulary"
            + (f" of {widened_from} tokens widened to {settings.draft_vocab} with the data's most frequent others)"
               if widened_from else ")"),
            f"- steps: {settings.steps} x {settings.batch_size} sequences, "
            f"training-time test {settings.ttt_steps} steps, "
            f"peak learning rate {settings.learning_rate}, matmuls in {matmul_dtype}",
            f"- time: {hours:.2f} h (this run; a resumed run counts from its resume) on {platform.machine()}, "
            f"{isa_summary()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
            f"- held-out top-1 agreement with the target's greedy token: {agreement or 'not evaluated'}"
            f" (loss {last.get('heldout_loss', 'n/a')})",
            "",
        ]
    )
