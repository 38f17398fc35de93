"""Prompt lookup that learns edits while it copies (``ngram-edit``): where the output departs from
the text it copies and then agrees with it again (a renamed identifier, a changed literal), the
change is kept as an edit and made in every later copy, and the context is matched with the edit
undone. On an editing task ("the same function with `name` renamed to `name_value`") plain lookup
loses a step or two at each later occurrence of the old name; this does not. Guesses are still
deterministic and verified as point masses: lossless whatever edits it learns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.core.drafts import BaseDrafter, Draft, DraftRequest, StepOutcome
from specdec.drafting.ngram import NGramIndex

REACH = 3  # most tokens an edit removes or adds
SYNC = 2  # tokens the two must agree on after an edit
MAX_EDITS = 16
OCCURRENCES = 8  # recent occurrences of each n-gram kept, to find the prompt's behind the output's


@dataclass(frozen=True)
class Edit:
    """``before`` (source tokens, the first an anchor both share) became ``after`` in the output."""

    before: tuple[int, ...]
    after: tuple[int, ...]


def learn_edit(tokens: list[int], source_at: int, output_at: int) -> Edit | None:
    """Where a copy of tokens[source_at:] failed at tokens[output_at] (the target chose another
    token), the smallest edit after which the copy and the output agree for SYNC tokens; None if
    there is none within REACH. Needs tokens up to output_at + REACH + SYNC."""
    if source_at < 1 or tokens[source_at - 1] != tokens[output_at - 1]:
        return None
    for total in range(1, 2 * REACH + 1):
        for removed in range(max(0, total - REACH), min(total, REACH) + 1):
            added = total - removed
            agreed = tokens[source_at + removed : source_at + removed + SYNC]
            resumed = tokens[output_at + added : output_at + added + SYNC]
            if source_at + removed + SYNC <= output_at and agreed == resumed:
                return Edit(tuple(tokens[source_at - 1 : source_at + removed]),
                            tuple(tokens[output_at - 1 : output_at + added]))
    return None


def apply_edits(prefix: list[int], copied: list[int], edits: list[Edit]) -> tuple[list[int], list[int | None]]:
    """``copied`` (what followed ``prefix`` in the source) with every edit made: the tokens, and
    where each came from in ``copied`` (None: an edit put it there). An edit whose ``before``
    starts in the prefix applies when its ``after`` agrees with the prefix there (an anchor
    extended)."""
    text, out, origins = prefix + copied, [], []
    position = 0
    while position < len(text):
        for edit in edits:
            size = len(edit.before)
            inside = len(prefix) - position  # tokens of the match that lie in the prefix
            if (tuple(text[position : position + size]) == edit.before
                    and tuple(text[position : position + len(edit.after)]) != edit.after
                    and (inside <= 0 or edit.after[:inside] == tuple(text[position : len(prefix)]))):
                common = next((k for k, (a, b) in enumerate(zip(edit.before, edit.after, strict=False)) if a != b),
                              min(size, len(edit.after)))
                for offset in range(max(0, inside), len(edit.after)):  # the shared start is still a copy
                    out.append(edit.after[offset])
                    origins.append(position + offset - len(prefix) if offset < common else None)
                position += size
                break
        else:
            if position >= len(prefix):
                out.append(text[position])
                origins.append(position - len(prefix))
            position += 1
    return out, origins


def undo_edits(tail: list[int], edits: list[Edit]) -> list[int]:
    """The context's tail as the source had it: each edit's ``after`` back to its ``before``."""
    for edit in edits:
        size, position = len(edit.after), 0
        result: list[int] = []
        while position < len(tail):
            if tuple(tail[position : position + size]) == edit.after:
                result += edit.before
                position += size
            else:
                result.append(tail[position])
                position += 1
        tail = result
    return tail


@dataclass
class EditState:
    index: NGramIndex
    prompt_length: int
    edits: list[Edit] = field(default_factory=list)
    sources: list[int | None] = field(default_factory=list)  # the last draft's source positions (None: edited in)
    drafted_at: int = 0  # context length when it was drafted
    pending: list[tuple[int, int]] = field(default_factory=list)  # (source_at, output_at) of failed copies
    # The last step's failed copy, when the target's token there is the latest: the next draft
    # resumes the copy at source_at, as if the target had inserted that token.
    resume: tuple[int, int] | None = None


def spelling_variants(tokenizer: Any, edit: Edit) -> list[Edit]:
    """An edit that extends one word (``name`` -> ``name _value``) for the word's other tokens:
    BPE spells it as one token after a space and another after a bracket, and the output makes the
    change at each."""
    if tokenizer is None or len(edit.before) != 1 or edit.after[:1] != edit.before:
        return []
    word = tokenizer.decode(list(edit.before)).strip()
    variants = []
    for spelling in (word, " " + word):
        ids = tokenizer.encode(spelling, add_special_tokens=False)
        if len(ids) == 1 and ids[0] != edit.before[0]:
            variants.append(Edit((ids[0],), (ids[0], *edit.after[1:])))
    return variants


class EditingNGramDrafter(BaseDrafter):
    """``ngram-edit``: see the module docstring. With the target's ``tokenizer``, an edit that
    extends a word is learned for its other spellings too (spelling_variants)."""

    def __init__(self, max_n: int = 4, min_n: int = 1, tokenizer: Any = None) -> None:
        NGramIndex(max_n, min_n)  # checks the sizes now
        self.max_n, self.min_n, self.tokenizer = max_n, min_n, tokenizer

    def describe(self) -> str:
        return f"n-gram lookup ({self.min_n}-{self.max_n}-grams) that learns edits while copying"

    def start(self, prompt_ids: torch.Tensor) -> EditState:
        index = NGramIndex(self.max_n, self.min_n, occurrences=OCCURRENCES)
        index.extend(prompt_ids.tolist())
        return EditState(index, len(index.tokens))

    def propose(self, request: DraftRequest, gamma: int) -> Draft:
        state: EditState = request.draft_state
        device = request.context.device
        state.sources, state.drafted_at = [], len(state.index.tokens)
        if gamma <= 0:
            return Draft.empty(device)
        tokens = state.index.tokens
        resume, state.resume = state.resume, None
        if resume is not None and len(tokens) == resume[1] + 1:
            match: tuple[int, int] | None = (0, resume[0])
        else:
            tail = tokens[-(self.max_n + REACH * 2):]
            match = state.index.find(tail)
            undone = undo_edits(tail, state.edits) if state.edits else tail
            if undone != tail:  # the unedited text is the prompt's (the output has the edits made)
                as_source = state.index.find(undone, before=state.prompt_length)
                if as_source is not None and (match is None or as_source[0] > match[0]):
                    match = as_source
        if match is None:
            return Draft.empty(device)
        start = match[1]
        longest = max((len(edit.before) for edit in state.edits), default=1)
        prefix = tokens[-longest:]  # the draft continues the context (as edited so far), not the source
        draft, origins = apply_edits(prefix, tokens[start : start + gamma], state.edits)
        draft = draft[:gamma]
        state.sources = [None if origin is None else start + origin for origin in origins[:gamma]]
        return Draft(torch.tensor(draft, dtype=torch.long, device=device))

    def observe(self, request: DraftRequest, outcome: StepOutcome) -> None:
        state: EditState = request.draft_state
        state.index.extend(outcome.emitted.tolist())
        rejected = outcome.num_accepted
        if rejected < outcome.num_drafted and rejected < len(state.sources):
            source_at = state.sources[rejected]
            if source_at is not None:
                state.pending.append((source_at, state.drafted_at + rejected))
                if rejected > 0:  # a copy that was running (a first-token miss is fresh text, not an edit)
                    state.resume = (source_at, state.drafted_at + rejected)
        tokens, waiting = state.index.tokens, []
        for source_at, output_at in state.pending:
            if len(tokens) < output_at + REACH + SYNC:
                waiting.append((source_at, output_at))
                continue
            edit = learn_edit(tokens, source_at, output_at)
            for learned in ([edit, *spelling_variants(self.tokenizer, edit)] if edit is not None else []):
                if learned not in state.edits:
                    state.edits = [learned, *state.edits][:MAX_EDITS]  # the newest first: it wins ties
        state.pending = waiting
