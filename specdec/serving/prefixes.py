"""A prefix cache: recent prompts' cache entries kept in spare rows, so that a prompt that begins
like one of them (a shared system prompt, the turns of a conversation) computes only the rest.

Exact, not approximate: the engine prefills in pieces of ``prefill_chunk`` tokens at multiples of
it, each alone in its forward (Engine.prefill), so the entries of a prompt's first k pieces are
the same bits whatever follows them. The cache keeps and reuses whole pieces only: a request that
starts from a copy holds exactly what its own prefill would have written, and goes on from there.
A drafter that reads the target's hidden states (a head) gets the stored features of the copied
part with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.core.engine import Request
from specdec.drafting.model import common_prefix
from specdec.models.base import ForkingCache


@dataclass
class StoredPrefix:
    tokens: list[int]  # the prompt tokens whose entries the row holds: whole prefill pieces
    row: int  # a spare row of the scheduler's cache
    features: torch.Tensor | None  # [len(tokens), features]: the drafter's hidden states there
    used: int = 0  # when it was last stored or reused (a counter), for least-recently-used eviction


class PrefixCache:
    """At most ``len(rows)`` stored prompts, in those rows of ``cache`` (which requests never get).

    ``store`` keeps a prefilled request's prompt (its whole pieces); ``reuse`` gives a new
    request a copy of the longest stored prefix of its prompt, at least ``min_tokens`` long and
    whole pieces of ``chunk`` tokens, and sets how much of its prompt is in (Request.fed)."""

    def __init__(self, cache: ForkingCache, rows: list[int], chunk: int, min_tokens: int | None = None) -> None:
        if chunk < 1:
            raise ValueError(f"a prefix cache needs prefill pieces of at least one token, got {chunk}")
        self.cache, self.chunk = cache, chunk
        self.min_tokens = max(chunk, min_tokens or chunk)
        self.free_rows = list(rows)
        self.entries: list[StoredPrefix] = []
        self.clock = 0
        self.queries = self.hits = self.tokens_reused = 0

    def whole_pieces(self, count: int) -> int:
        return count - count % self.chunk

    def store(self, request: Request, features: torch.Tensor | None) -> None:  # features [fed, features]
        """Keep ``request``'s prompt entries (just prefilled), unless a stored prefix covers them;
        one it extends is replaced, else the least recently used goes when no row is free."""
        length = self.whole_pieces(request.fed)
        if length < self.min_tokens:
            return
        tokens = request.prompt_ids[:length]
        self.clock += 1
        for entry in self.entries:
            shared = common_prefix(entry.tokens, tokens)
            if shared == length:  # already held (or a longer prompt with it)
                entry.used = self.clock
                return
            if shared == len(entry.tokens):  # the new prompt extends it: it takes its row
                self.entries.remove(entry)
                self.free_rows.append(entry.row)
                break
        if not self.free_rows:
            oldest = min(self.entries, key=lambda entry: entry.used)
            self.entries.remove(oldest)
            self.free_rows.append(oldest.row)
        row = self.free_rows.pop()
        self.cache.fork(request.row, row, length)
        self.entries.append(StoredPrefix(tokens, row, None if features is None else features[:length], self.clock))

    def evict_oldest(self) -> bool:
        """Drop the least recently used stored prompt (its row emptied, a paged cache's blocks
        freed where no request shares them); False when none is stored."""
        if not self.entries:
            return False
        oldest = min(self.entries, key=lambda entry: entry.used)
        self.entries.remove(oldest)
        self.cache.rollback(oldest.row, 0)
        self.free_rows.append(oldest.row)
        return True

    def reuse(self, request: Request) -> int:
        """Copy the longest stored prefix of the request's prompt into its row (whole pieces, up to
        the prompt's last token but one: the first step feeds the last); returns the tokens reused
        (0: none)."""
        self.queries += 1
        usable = self.whole_pieces(len(request.prompt_ids) - 1)
        best, best_length = None, 0
        for entry in self.entries:
            length = self.whole_pieces(min(common_prefix(entry.tokens, request.prompt_ids), usable))
            if length > best_length:
                best, best_length = entry, length
        if best is None or best_length < self.min_tokens or request.fed:
            return 0
        self.clock += 1
        best.used = self.clock
        self.cache.fork(best.row, request.row, best_length)
        request.fed = best_length
        if best.features is not None:
            request.prompt_hidden = [best.features[:best_length]]
        self.hits += 1
        self.tokens_reused += best_length
        return best_length
