"""A datastore of code for retrieval drafts (REST, He et al. NAACL 2024): the token ids of a corpus
and their suffix array, on disk, memory-mapped at load.

Layout of a datastore folder:
- ``tokens.bin``: every document's token ids as big-endian uint32, each document followed by
  SEPARATOR (no token has that id, so no match crosses it and every continuation stops there);
- ``suffixes.bin``: the start of every suffix that begins with a token, in lexicographic order of
  the token sequences (int32, or int64 past 2**31 bytes; ``meta.json`` says which);
- ``meta.json``: the tokenizer's fingerprint (a datastore of another tokenizer is refused), the
  sizes, the sources and the build time.

The suffix array is built by libdivsufsort (pydivsufsort) over the tokens' bytes: big-endian
fixed-width ids compare byte by byte as they compare id by id, so the byte suffixes that start at
a token boundary are the token suffixes, in token order. Lookups are binary searches on the two
mapped files (bisect with a key that slices the token bytes): microseconds, no forward pass.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import mmap
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SEPARATOR = 0xFFFFFFFF  # after each document: an id no tokenizer has
TOKEN_BYTES = 4
FORMAT = 1  # meta.json's "format": a datastore of another layout is refused


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A digest of the tokenizer's vocabulary (token text -> id, added tokens included): two
    tokenizers with the same fingerprint map every id to the same text. Kept per tokenizer object
    for this process (a 150k-token vocabulary takes ~0.25 s to digest, and start-up asks twice)."""
    try:
        return _FINGERPRINTS[tokenizer]
    except (KeyError, TypeError):  # TypeError: an object without weak references is digested each time
        pass
    vocabulary = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    fingerprint = hashlib.sha256(json.dumps(vocabulary, ensure_ascii=False).encode()).hexdigest()[:16]
    try:
        _FINGERPRINTS[tokenizer] = fingerprint
    except TypeError:
        pass
    return fingerprint


_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class BuildReport:
    """What building a datastore took."""

    tokens: int
    documents: int
    seconds: float
    disk_bytes: int
    memory_bytes: int | None = None  # the build's own peak resident memory (corpus_index.build_index), if known


def write_datastore(folder: Path, documents: Iterable[Sequence[int]], fingerprint: str,
                    sources: Sequence[str] = ()) -> BuildReport:
    """Writes a datastore of ``documents`` (each a list of token ids) into ``folder``; the suffix
    array is sorted in one call to libdivsufsort."""
    from pydivsufsort import divsufsort

    began = time.perf_counter()
    pieces, count = [], 0
    for document in documents:
        pieces.append(np.asarray([*document, SEPARATOR], dtype=">u4"))
        count += 1
    # (concatenate returns native byte order: big-endian is asked for again)
    tokens = np.concatenate(pieces).astype(">u4", copy=False) if pieces else np.zeros(0, dtype=">u4")
    if len(tokens) == count:
        raise ValueError("a datastore needs at least one document with tokens")
    byte_suffixes = divsufsort(tokens.view(np.uint8))  # [4 * tokens] byte offsets, sorted
    starts = byte_suffixes[byte_suffixes % TOKEN_BYTES == 0] // TOKEN_BYTES
    starts = starts[tokens[starts] != SEPARATOR]  # a suffix that starts at a separator matches nothing
    folder.mkdir(parents=True, exist_ok=True)
    tokens.tofile(folder / "tokens.bin")
    starts.tofile(folder / "suffixes.bin")
    seconds = time.perf_counter() - began
    report = BuildReport(int(len(tokens)) - count, count, seconds, int(tokens.nbytes + starts.nbytes))
    meta = {"format": FORMAT, "tokenizer": fingerprint, "suffix_dtype": str(starts.dtype), "tokens": report.tokens,
            "documents": count, "build_seconds": round(seconds, 3), "sources": list(sources)}
    (folder / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return report


class Datastore:
    """A datastore folder, memory-mapped: ``find`` the longest suffix of a context it holds, then
    read the ``continuations`` of that suffix's occurrences."""

    def __init__(self, folder: Path, meta: dict) -> None:
        self.folder, self.meta = folder, meta
        self._bytes = mapped(folder / "tokens.bin")  # sliced as bytes: fast compares
        self.tokens = np.frombuffer(self._bytes, dtype=">u4")
        suffix_bytes = mapped(folder / "suffixes.bin")
        self.suffixes = np.frombuffer(suffix_bytes, dtype=np.dtype(meta["suffix_dtype"]))
        self._starts = memoryview(suffix_bytes).cast(self.suffixes.dtype.char)  # plain ints at Python speed: bisect

    @property
    def name(self) -> str:
        return self.folder.name

    @property
    def disk_bytes(self) -> int:
        return sum(path.stat().st_size for path in self.folder.iterdir() if path.is_file())

    @staticmethod
    def open(folder: str | Path, fingerprint: str | None = None) -> Datastore:
        """The datastore in ``folder``; ValueError (one line) if it was built for another tokenizer
        than the one ``fingerprint`` names, or is not a datastore."""
        folder = Path(folder)
        try:
            meta = json.loads((folder / "meta.json").read_text())
        except (OSError, ValueError):
            raise ValueError(f"{folder} is not a datastore (no readable meta.json): build one with "
                             "`specdec index build PATH --out DIR`") from None
        if meta.get("format") != FORMAT:
            raise ValueError(f"{folder} is a datastore of another format ({meta.get('format')}, this specdec reads "
                             f"{FORMAT}): build it again")
        if fingerprint is not None and meta.get("tokenizer") != fingerprint:
            raise ValueError(f"the datastore {folder} was built with another tokenizer ({meta.get('tokenizer')}) than "
                             f"the target's ({fingerprint}): build one with the target's tokenizer (--target)")
        return Datastore(folder, meta)

    def _prefix(self, width: int) -> Callable[[int], bytes]:
        """The first ``width`` bytes of the suffix that starts at a token: the binary searches' key."""
        return lambda start: self._bytes[start * TOKEN_BYTES : start * TOKEN_BYTES + width]

    def _first_at_or_after(self, pattern: bytes) -> int:
        """The first row of the suffix array whose suffix is not below ``pattern``."""
        return bisect.bisect_left(self._starts, pattern, key=self._prefix(len(pattern)))

    def _holds(self, row: int, pattern: bytes) -> bool:
        if row >= len(self._starts):
            return False
        start = self._starts[row] * TOKEN_BYTES
        return self._bytes[start : start + len(pattern)] == pattern

    def find(self, context: Sequence[int], max_n: int, min_n: int = 1) -> tuple[int, int, int]:
        """(n, first, end): the longest suffix of ``context`` of n tokens (min_n <= n <= max_n) that
        the datastore holds, and its rows [first, end) of the suffix array; (0, 0, 0) if none. A
        binary search on n: wherever a suffix occurs, every shorter one does."""
        encoded = np.asarray(context[-max_n:], dtype=">u4").tobytes()
        found, low, high = (0, 0), min_n, min(max_n, len(context))
        while low <= high:
            n = (low + high) // 2
            pattern = encoded[len(encoded) - n * TOKEN_BYTES :]
            row = self._first_at_or_after(pattern)
            if self._holds(row, pattern):
                found, low = (n, row), n + 1
            else:
                high = n - 1
        n, first = found
        if n == 0:
            return 0, 0, 0
        pattern = encoded[len(encoded) - n * TOKEN_BYTES :]
        end = bisect.bisect_right(self._starts, pattern, lo=first, key=self._prefix(len(pattern)))
        return n, first, end

    def continuations(self, n: int, first: int, end: int, length: int, most: int) -> list[list[int]]:
        """Up to ``length`` tokens after each of at most ``most`` occurrences of the suffix found
        by ``find`` (rows [first, end), every one of them if they are few, else rows spread evenly
        over the range: the rows are sorted by what follows, so an even spread samples the
        continuations' frequencies), each cut at its document's end."""
        if end <= first or length <= 0:
            return []
        rows = np.unique(np.linspace(first, end - 1, num=min(most, end - first)).astype(np.int64))
        places = self.suffixes[rows].astype(np.int64)[:, None] + n + np.arange(length)  # [occurrences, length]
        read = self.tokens[np.minimum(places, len(self.tokens) - 1)].astype(np.int64)
        return [cut_at_separator(row) for row in read.tolist()]


def mapped(path: Path) -> mmap.mmap:
    """A file's bytes, mapped read-only: the pages are read as lookups touch them, and shared by
    every process that maps the same datastore."""
    with open(path, "rb") as file:
        return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)


def cut_at_separator(tokens: list[int]) -> list[int]:
    """A continuation up to its document's end."""
    return tokens[: tokens.index(SEPARATOR)] if SEPARATOR in tokens else tokens
