"""`specdec train`: text files -> BPE tokenizer -> target -> distilled draft, as HF folders.

Everything lands under --out: tokenizer/, tokens (cached), checkpoints/ (resumable with
--resume), target/ and draft/ (model folders with a model card each), loss_curves.png and
training_summary.json.
"""

from __future__ import annotations

import datetime
import json
import platform
import shlex
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from specdec.corpus_files import collect_files
from specdec.training.data import TokenWindows, code_prompts, encode_files, split_files, train_tokenizer
from specdec.training.trainer import History, ModelShape, Trainer, TrainPlan, plot_losses, progress_bar


@dataclass(kw_only=True)
class CorpusRun:
    """What every training run shares: its files, output folder, batching and saving."""

    data: list[str]
    out: str
    seq_len: int = 256
    batch_size: int = 16
    heldout_fraction: float = 0.03
    seed: int = 0
    save_dtype: str = "float16"
    resume: bool = False
    command: str = ""
    suffixes: tuple[str, ...] = (".py",)


@dataclass(kw_only=True)
class TrainConfig(CorpusRun):
    target_shape: ModelShape
    draft_shape: ModelShape
    target_plan: TrainPlan
    draft_plan: TrainPlan
    vocab_size: int = 4096
    max_positions: int = 2048


def count_parameters(model) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def prepare_data(config: TrainConfig, out: Path, console: Console):
    from transformers import AutoTokenizer

    files = collect_files(config.data, config.suffixes)
    train_files, heldout_files = split_files(files, config.heldout_fraction)
    tokenizer_dir = out / "tokenizer"
    if config.resume and (tokenizer_dir / "tokenizer.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    else:
        with console.status(f"training a {config.vocab_size}-token BPE tokenizer on {len(train_files)} files"):
            tokenizer = train_tokenizer(train_files, config.vocab_size)
        tokenizer.save_pretrained(str(tokenizer_dir))
    streams = token_streams(tokenizer, train_files, heldout_files, out, config.resume, console)
    return tokenizer, streams, train_files, heldout_files


def token_streams(tokenizer, train_files: list[Path], heldout_files: list[Path], out: Path, resume: bool,
                  console: Console) -> dict[str, np.ndarray]:
    """The train and held-out token streams, cached under ``out`` (reused with resume)."""
    streams = {}
    for split, split_files_ in (("train", train_files), ("heldout", heldout_files)):
        path = out / f"{split}_tokens.npy"
        if resume and path.is_file():
            streams[split] = np.load(path)
        else:
            with console.status(f"tokenizing {len(split_files_)} {split} files"):
                streams[split] = encode_files(tokenizer, split_files_)
            np.save(path, streams[split])
    console.print(f"data: {len(train_files)} train files ({streams['train'].shape[0]:,} tokens), "
                  f"{len(heldout_files)} held-out files ({streams['heldout'].shape[0]:,} tokens)")
    return streams


def train_one(model, name: str, config: TrainConfig, streams, out: Path, plan: TrainPlan, console: Console,
              teacher=None) -> History:
    seed = config.seed + (1 if teacher is not None else 0)
    train = TokenWindows(streams["train"], config.seq_len, config.batch_size, seed)
    heldout = TokenWindows(streams["heldout"], config.seq_len, 1, seed)
    trainer = Trainer(model, train, heldout, plan, out / "checkpoints" / f"{name}.pt", teacher=teacher)
    if config.resume and trainer.load_checkpoint():
        console.print(f"{name}: resumed at step {trainer.step}")
    with progress_bar() as progress:
        history = trainer.run(progress)
    console.print(f"{name}: {history.total_steps} steps, held-out loss {history.eval_loss[-1]:.3f} nats/token, "
                  f"{history.tokens_per_second:.0f} training tokens/s")
    return history


def save_model(model, tokenizer, folder: Path, dtype: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    copy = type(model)(model.config)
    copy.load_state_dict(model.state_dict())
    copy.to(getattr(torch, dtype)).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))


def model_card(name: str, role: str, model, history: History, config: TrainConfig, summary: dict) -> str:
    shape = config.target_shape if name == "target" else config.draft_shape
    tokens_seen = history.total_steps * config.batch_size * config.seq_len
    agreement = f"\n- held-out top-1 agreement with the target: {history.eval_agreement[-1]:.3f}" \
        if history.eval_agreement else ""
    objective = "next-token cross-entropy on the training files" if name == "target" else \
        "forward KL to the target's soft labels on the training files (DistillSpec-style distillation)"
    return f"""# specdec default {name}

{role}

- architecture: Llama (transformers `LlamaForCausalLM`), {count_parameters(model):,} parameters,
  hidden {shape.hidden_size}, {shape.num_layers} layers, {shape.num_heads} heads ({shape.num_kv_heads} key/value heads),
  MLP {shape.intermediate_size}, vocabulary {config.vocab_size} (byte-level BPE), tied embeddings,
  context {config.max_positions} positions; weights stored as {config.save_dtype}
- data: the Python source files of the CPython {platform.python_version()} standard library
  ({summary['train_files']} training files, {summary['train_tokens']:,} tokens; {summary['heldout_files']} files,
  {summary['heldout_tokens']:,} tokens, held out by a hash of their names)
- objective: {objective}
- training: {history.total_steps} steps of {config.batch_size} x {config.seq_len} tokens ({tokens_seen:,} tokens),
  AdamW, peak learning rate {(config.target_plan if name == 'target' else config.draft_plan).learning_rate},
  {history.seconds / 60:.1f} minutes on {summary['machine']}
- held-out cross-entropy: {history.eval_loss[-1]:.3f} nats per token{agreement}
- trained {summary['date']} with:

```bash
{config.command}
```
"""


def train_pair(config: TrainConfig, console: Console | None = None) -> dict:
    from transformers import LlamaForCausalLM

    console = console or Console(stderr=True)
    out = Path(config.out)
    (out / "checkpoints").mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    tokenizer, streams, train_files, heldout_files = prepare_data(config, out, console)
    vocab = len(tokenizer)
    target = LlamaForCausalLM(config.target_shape.llama_config(vocab, config.max_positions, tokenizer))
    target_history = train_one(target, "target", config, streams, out, config.target_plan, console)
    target.eval()
    for parameter in target.parameters():
        parameter.requires_grad_(False)
    draft = LlamaForCausalLM(config.draft_shape.llama_config(vocab, config.max_positions, tokenizer))
    draft_history = train_one(draft, "draft", config, streams, out, config.draft_plan, console, teacher=target)

    summary = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "train_files": len(train_files), "heldout_files": len(heldout_files),
        "train_tokens": int(streams["train"].shape[0]), "heldout_tokens": int(streams["heldout"].shape[0]),
        "heldout_file_names": [str(f) for f in heldout_files],
        "target_parameters": count_parameters(target), "draft_parameters": count_parameters(draft),
        "target": asdict(target_history) | {"steps": [], "train_loss": []},
        "draft": asdict(draft_history) | {"steps": [], "train_loss": []},
        "command": config.command,
    }
    roles = {
        "target": "The target model of specdec's bundled pair: `specdec generate` decodes with it by default.",
        "draft": "The draft model of specdec's bundled pair, distilled from the target; same tokenizer.",
    }
    for name, model, history in (("target", target, target_history), ("draft", draft, draft_history)):
        save_model(model, tokenizer, out / name, config.save_dtype)
        (out / name / "README.md").write_text(model_card(name, roles[name], model, history, config, summary))
    tokens_per_step = config.batch_size * config.seq_len
    plot_losses({"target": target_history, "draft": draft_history},
                {"target": tokens_per_step, "draft": tokens_per_step}, out / "loss_curves.png")
    (out / "training_summary.json").write_text(json.dumps(summary, indent=1))
    (out / "heldout_prompts.json").write_text(json.dumps(code_prompts(heldout_files, 24), indent=1))
    console.print(f"saved {out / 'target'}, {out / 'draft'} and {out / 'loss_curves.png'}")
    return summary


def command_line() -> str:
    return shlex.join(["specdec", *sys.argv[1:]])
