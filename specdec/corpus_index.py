"""Datastores of code for the corpus drafter (specdec.drafting.corpus): files tokenized with the
target's tokenizer into a datastore (specdec.drafting.datastore), the default datastore of a code
target (this Python's standard library, built once per tokenizer and cached), and what ``--index``
asks for.

The default datastore leaves out files that quote a benchmark suite, by the rule that keeps them
out of training data (specdec.corpus_files): a drafter never retrieves the answers it is measured
on. A user's own index (`specdec index build`) keeps every file it is given.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from specdec.corpus_files import INSTALLED_FOLDERS, collect_files, read_text, standard_library
from specdec.drafting.datastore import BuildReport, Datastore, tokenizer_fingerprint, write_datastore
from specdec.names import NO_INDEX

DEFAULT_INDEX = "default"  # --index default: the default datastore, for any target
# The default datastore leaves out the standard library's own tests: a third of its tokens are
# test suites' idioms, few of them code a user writes, and the build stays near a minute.
DEFAULT_SKIPPED = frozenset({"test", "tests", "idle_test"})
FILES_PER_BATCH = 32  # files tokenized in one call (the fast tokenizers run a batch in parallel)


def encode_files(tokenizer: Any, files: Sequence[Path], progress: Callable[[str], None] | None = None,
                 ) -> Iterator[list[int]]:
    """Each file's token ids (no special tokens), in order, a batch of files at a time."""
    for start in range(0, len(files), FILES_PER_BATCH):
        texts = [read_text(file) for file in files[start : start + FILES_PER_BATCH]]
        if callable(tokenizer):  # transformers: one batched call, no warning for long files
            yield from tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        else:  # llama.cpp's tokenizer: one file at a time
            yield from (tokenizer.encode(text, add_special_tokens=False) for text in texts)
        if progress is not None:
            progress(f"tokenized {min(start + FILES_PER_BATCH, len(files))} of {len(files)} files")


def build_index(paths: Sequence[str | Path], tokenizer: Any, out: Path, globs: Sequence[str] = (),
                progress: Callable[[str], None] | None = None,
                skip_folders: frozenset[str] = frozenset({"__pycache__"}), leave_out_suites: bool = False,
                ) -> BuildReport:
    """A datastore in ``out`` of the files under ``paths`` (``.py`` unless ``globs`` say otherwise),
    tokenized with ``tokenizer``; ``leave_out_suites``: without the files that quote a benchmark
    suite (the default datastore's rule, not a user's index). Written beside ``out`` first, then
    moved into place: an interrupted build leaves no half datastore."""
    files = collect_files(paths, skip_folders=skip_folders, what="corpus", globs=globs,
                          leave_out_suites=leave_out_suites)
    partial = out.with_name(f"{out.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    before = process_memory("VmRSS")
    counted = restart_peak()
    report = write_datastore(partial, encode_files(tokenizer, files, progress), tokenizer_fingerprint(tokenizer),
                             [str(Path(path).resolve()) for path in paths])
    peak = process_memory("VmHWM") if counted else None
    if peak is not None and before is not None:
        report = dataclasses.replace(report, memory_bytes=max(0, peak - before))
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)
    return report


def process_memory(field: str) -> int | None:
    """A field of /proc/self/status in bytes (VmRSS: resident now; VmHWM: the peak), None off Linux."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    return None


def restart_peak() -> bool:
    """Count the peak resident memory (VmHWM) from now on (Linux: /proc/self/clear_refs); False
    where it cannot be (then a build's own peak is not known)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def describe_build(report: BuildReport, out: Path) -> str:
    memory = "" if report.memory_bytes is None else (
        f", {report.memory_bytes / 2**20:.0f} MiB of memory at its peak (beyond what the process held before)")
    return (f"datastore {out}: {report.tokens:,} tokens of {report.documents:,} files, built in "
            f"{report.seconds:.1f} s (tokenizing included), {report.disk_bytes / 2**20:.1f} MiB on disk{memory}")


def default_index_folder(fingerprint: str) -> Path:
    from specdec.machine import cache_root

    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return cache_root() / "corpus" / f"python{version}-stdlib-{fingerprint}"


def default_datastore(tokenizer: Any, say: Callable[[str], None]) -> Datastore:
    """The default datastore for ``tokenizer``: built on first use (said), then read from the cache."""
    fingerprint = tokenizer_fingerprint(tokenizer)
    folder = default_index_folder(fingerprint)
    if not (folder / "meta.json").is_file():
        say(f"building the default datastore (this Python's standard library) for this tokenizer, once: {folder}")
        folder.parent.mkdir(parents=True, exist_ok=True)
        report = build_index(standard_library(), tokenizer, folder, skip_folders=INSTALLED_FOLDERS | DEFAULT_SKIPPED,
                             leave_out_suites=True)
        say(describe_build(report, folder))
    return Datastore.open(folder, fingerprint)


def is_code_model(name: str) -> bool:
    """Whether a target is a code model, by its name (Qwen2.5-Coder, CodeLlama, StarCoder...):
    those get the default datastore unasked."""
    return "code" in name.lower()


def datastores_for(indexes: Sequence[str] | None, target: Any, say: Callable[[str], None]) -> list[Datastore]:
    """What ``--index`` asks for, opened for ``target``'s tokenizer: each DIR, ``default`` (the
    default datastore), ``none`` (no datastore); unset, the default datastore for a code target.
    ValueError (one line) for a datastore of another tokenizer or a target without a tokenizer."""
    if indexes is None:
        indexes = [DEFAULT_INDEX] if is_code_model(target.name) and target.tokenizer is not None else []
        if indexes:
            say("corpus drafts: the default datastore (this Python's standard library) for a code target; "
                "--index none turns it off")
    if NO_INDEX in indexes:
        if len(indexes) > 1:
            raise ValueError(f"--index {NO_INDEX} turns datastores off: give it alone")
        return []
    if indexes and target.tokenizer is None:
        raise ValueError(f"--index needs the target's tokenizer, and {target.name} has none")
    fingerprint = tokenizer_fingerprint(target.tokenizer) if indexes else None
    return [default_datastore(target.tokenizer, say) if index == DEFAULT_INDEX else Datastore.open(index, fingerprint)
            for index in indexes]
