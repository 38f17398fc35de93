"""`specdec train --teacher MODEL`: distil a draft for an existing target (DistillSpec-style).

The draft starts as a few of the teacher's own layers (say the first two and the last) over the
teacher's embedding and tied output head, which stay frozen: the draft shares the target's
tokenizer and embedding space, and only its layers are trained, by forward KL to the teacher's
soft labels on teacher-forced windows of the training files. Only those layers are saved
(``layers.safetensors``); ``assemble_draft`` adds the teacher's embedding back at load time, so a
draft of a 135M target ships as a few megabytes.
"""

from __future__ import annotations

import datetime
import json
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from specdec.corpus_files import collect_files
from specdec.models.building import LAYERS_FILE
from specdec.training.data import TokenWindows, split_files
from specdec.training.pipeline import CorpusRun, token_streams
from specdec.training.trainer import History, Trainer, TrainPlan, plot_losses, progress_bar

SHARED = ("model.embed_tokens.weight", "lm_head.weight")  # the teacher's, never trained or saved
SOURCE_FILE = "draft_source.json"


@dataclass(kw_only=True)
class DistillConfig(CorpusRun):
    teacher: str  # a model folder (transformers format)
    layers: tuple[int, ...]  # teacher layers the draft starts from, in order
    plan: TrainPlan
    output_tokens: int = 0  # > 0: the draft proposes only this many of the most frequent training tokens


def write_output_tokens(train_tokens: np.ndarray, heldout_tokens: np.ndarray, vocab_size: int, count: int,
                        folder: Path) -> float:
    """The ``count`` most frequent training tokens as the draft's output vocabulary
    (OUTPUT_TOKENS_FILE, read by load()); returns the share of held-out tokens they cover."""
    from specdec.models.building import OUTPUT_TOKENS_FILE

    counts = np.bincount(train_tokens, minlength=vocab_size)
    keep = np.sort(np.argsort(-counts, kind="stable")[:count])
    coverage = float(np.isin(heldout_tokens, keep).mean())
    (folder / OUTPUT_TOKENS_FILE).write_text(json.dumps({
        "source": f"the {count} most frequent tokens of the training files", "heldout_coverage": round(coverage, 4),
        "token_ids": keep.tolist()}))
    return coverage


def layer_subset(teacher, layers: tuple[int, ...]):
    """A LlamaForCausalLM-like copy of ``teacher`` keeping only ``layers``; embedding and head
    are the teacher's own tensors, frozen."""
    import copy

    count = teacher.config.num_hidden_layers
    if not layers or any(not 0 <= index < count for index in layers):
        raise ValueError(f"--draft-layers must pick among the teacher's layers 0..{count - 1}, got {list(layers)}")
    config = copy.deepcopy(teacher.config)
    config.num_hidden_layers = len(layers)
    draft = type(teacher)(config)
    teacher_state = teacher.state_dict()
    state = {}
    for name in draft.state_dict():
        source = name
        if name.startswith("model.layers."):
            index, rest = name[len("model.layers."):].split(".", 1)
            source = f"model.layers.{layers[int(index)]}.{rest}"
        state[name] = teacher_state[source].clone()
    draft.load_state_dict(state)
    for name, parameter in draft.named_parameters():
        parameter.requires_grad_(name not in SHARED)
    return draft


def trained_weights(draft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {name: tensor.to(dtype).contiguous() for name, tensor in draft.state_dict().items() if name not in SHARED}


def distill_draft(config: DistillConfig, console: Console | None = None) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    console = console or Console(stderr=True)
    out = Path(config.out)
    (out / "checkpoints").mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    tokenizer = AutoTokenizer.from_pretrained(config.teacher)
    teacher = AutoModelForCausalLM.from_pretrained(config.teacher, dtype=torch.float32).eval()
    for parameter in teacher.parameters():
        parameter.requires_grad_(False)

    files = collect_files(config.data, config.suffixes)
    train_files, heldout_files = split_files(files, config.heldout_fraction)
    streams = token_streams(tokenizer, train_files, heldout_files, out, config.resume, console)

    draft = layer_subset(teacher, config.layers)
    train = TokenWindows(streams["train"], config.seq_len, config.batch_size, config.seed + 1)
    heldout = TokenWindows(streams["heldout"], config.seq_len, 1, config.seed + 1)
    trainer = Trainer(draft, train, heldout, config.plan, out / "checkpoints" / "draft.pt", teacher=teacher)
    if config.resume and trainer.load_checkpoint():
        console.print(f"draft: resumed at step {trainer.step}")
    with progress_bar() as progress:
        history = trainer.run(progress)
    console.print(f"draft: {history.total_steps} steps, held-out loss {history.eval_loss[-1]:.3f} nats/token, "
                  f"top-1 agreement {history.eval_agreement[-1]:.3f}, {history.tokens_per_second:.0f} tokens/s")

    from safetensors.torch import save_file

    folder = out / "draft"
    folder.mkdir(parents=True, exist_ok=True)
    save_file(trained_weights(draft, getattr(torch, config.save_dtype)), str(folder / LAYERS_FILE),
              metadata={"format": "pt"})
    draft.config.save_pretrained(str(folder))
    summary = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "teacher": config.teacher, "teacher_layers": list(config.layers),
        "train_files": len(train_files), "heldout_files": len(heldout_files),
        "train_tokens": int(streams["train"].shape[0]), "heldout_tokens": int(streams["heldout"].shape[0]),
        "trained_parameters": sum(p.numel() for p in draft.parameters() if p.requires_grad),
        "draft": asdict(history) | {"steps": [], "train_loss": []},
        "command": config.command, "seq_len": config.seq_len, "batch_size": config.batch_size,
    }
    if config.output_tokens:
        summary["output_tokens"] = config.output_tokens
        summary["output_tokens_heldout_coverage"] = write_output_tokens(
            streams["train"], streams["heldout"], draft.config.vocab_size, config.output_tokens, folder)
    (folder / SOURCE_FILE).write_text(json.dumps(summary, indent=1))
    (folder / "README.md").write_text(draft_card(summary, history, config))
    plot_losses({"draft": history}, {"draft": config.batch_size * config.seq_len}, out / "loss_curves.png")
    console.print(f"saved {folder} and {out / 'loss_curves.png'}")
    return summary


def output_line(summary: dict) -> str:
    if not summary.get("output_tokens"):
        return ""
    return (f"- output: the {summary['output_tokens']} most frequent training tokens only (`output_tokens.json`, "
            f"{summary['output_tokens_heldout_coverage']:.1%} of held-out tokens), a cheaper head\n")


def draft_card(summary: dict, history: History, config: DistillConfig) -> str:
    tokens_seen = history.total_steps * config.batch_size * config.seq_len
    return f"""# Distilled draft

A draft for `{Path(config.teacher).name}`: its layers {list(config.layers)} (of the teacher's), trained;
its embedding and tied output head are the teacher's own, frozen, and not stored here
(`{LAYERS_FILE}` holds the {summary['trained_parameters']:,} trained parameters as {config.save_dtype}).

- objective: forward KL to the teacher's soft labels on teacher-forced windows of
  {config.seq_len} tokens (DistillSpec-style distillation)
- data: {summary['train_files']} Python files ({summary['train_tokens']:,} tokens);
  {summary['heldout_files']} files ({summary['heldout_tokens']:,} tokens) held out by a hash of their names
- training: {history.total_steps} steps of {config.batch_size} x {config.seq_len} tokens ({tokens_seen:,} tokens),
  AdamW, peak learning rate {config.plan.learning_rate}, {history.seconds / 60:.1f} minutes on {summary['machine']}
- held-out files: cross-entropy {history.eval_loss[-1]:.3f} nats per token (on their next tokens), top-1
  agreement with the teacher {history.eval_agreement[-1]:.3f} (teacher-forced)
{output_line(summary)}- trained {summary['date']} with:

```bash
{config.command}
```
"""
