"""A head's drafts read its logits over the draft vocabulary's columns (LogitColumns): greedy chains
pick the tokens the logits mapped into the target's whole vocabulary pick, ties included (argmax
takes the first, and the columns' ids ascend); greedy trees the same children where no two tie
(topk orders ties as it likes, in either form: a draft's choice only, verification is exact); sampled
chains draw from exactly the q (same bits, same draws) the mapped logits give."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from specdec import SamplingParams
from specdec.core.rules import RejectionRule
from specdec.drafting.lockstep import run_in_lockstep
from specdec.drafting.model import LogitColumns, chain_steps
from specdec.drafting.tree import draft_distribution, tree_steps

VOCAB, COLUMNS, STEPS = 300, 48, 6


@dataclass
class Request:  # what a drafting routine reads of a request (core.drafts.DraftRequest)
    sampling: SamplingParams
    rule: Any = None
    context: torch.Tensor = field(default_factory=lambda: torch.arange(5))
    stop_early: Any = None
    node_budget: int | None = None
    matcher: Any = None
    draft_state: Any = None


def columns_and_logits(seed: int, ties: bool = True) -> tuple[LogitColumns, list[torch.Tensor]]:
    """A draft vocabulary of COLUMNS target ids and a few steps of its logits [4, COLUMNS]: small
    integers, so that the largest ones tie often, or normal draws, which never tie."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randperm(VOCAB, generator=generator)[:COLUMNS].sort().values
    logits = [torch.randint(0, 5, (4, COLUMNS), generator=generator).float() if ties
              else torch.randn(4, COLUMNS, generator=generator) for _ in range(STEPS)]
    return LogitColumns(ids, VOCAB), logits


def answered(logits: list[torch.Tensor], widen: LogitColumns | None):
    """A lockstep answer that hands a routine the next step's logits (mapped wide, with widen), as
    many rows as it asks about: the head's forward, made up."""
    answers = iter(logits)

    def answer(asking: list[int], questions: list[Any]) -> list[torch.Tensor]:
        step = next(answers)
        rows = [len(question[2]) if isinstance(question, tuple) else 1 for question in questions]
        picked = [step[:count] for count in rows]
        return [widen.widen(rows_) if widen else rows_ for rows_ in picked]

    return answer


def test_widen_maps_each_column_to_its_token():
    columns, logits = columns_and_logits(0)
    wide = columns.widen(logits[0])
    assert wide.shape == (4, VOCAB)
    assert torch.equal(wide[:, columns.token_ids], logits[0])
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[columns.token_ids] = False
    assert torch.isneginf(wide[:, outside]).all()


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("stops", [False, True])
def test_greedy_chain_over_columns_picks_the_wide_tokens(seed, stops):
    columns, logits = columns_and_logits(seed)
    stop_rule = (lambda length, probability: probability < 0.05) if stops else None  # on the draft's confidence
    narrow_request = Request(SamplingParams(max_new_tokens=8, temperature=0.0), stop_early=stop_rule)
    wide_request = Request(SamplingParams(max_new_tokens=8, temperature=0.0), stop_early=stop_rule)
    narrow = run_in_lockstep([chain_steps(logits[0][:1], STEPS, narrow_request, columns)],
                             answered(logits[1:], None))[0]
    wide = run_in_lockstep([chain_steps(columns.widen(logits[0][:1]), STEPS, wide_request)],
                           answered(logits[1:], columns))[0]
    assert narrow.tokens.tolist() == wide.tokens.tolist()
    assert narrow.probs is None and wide.probs is None
    assert set(narrow.tokens.tolist()) <= set(columns.token_ids.tolist())


@pytest.mark.parametrize("seed", range(3))
def test_sampled_chain_over_columns_draws_from_the_same_q(seed):
    columns, logits = columns_and_logits(seed)
    sampling = SamplingParams(max_new_tokens=8, temperature=0.8, top_k=20)
    drafts = []
    for narrow in (True, False):
        rule = RejectionRule(torch.Generator().manual_seed(seed))
        request = Request(sampling, rule=rule)
        first = logits[0][:1] if narrow else columns.widen(logits[0][:1])
        routine = chain_steps(first, STEPS, request, columns) if narrow else chain_steps(first, STEPS, request)
        drafts.append(run_in_lockstep([routine], answered(logits[1:], None if narrow else columns))[0])
    assert drafts[0].tokens.tolist() == drafts[1].tokens.tolist()
    assert drafts[0].probs is not None and drafts[1].probs is not None
    assert drafts[0].probs.shape[-1] == VOCAB and torch.equal(drafts[0].probs, drafts[1].probs)


@pytest.mark.parametrize("seed", range(5))
def test_greedy_tree_over_columns_picks_the_wide_tokens(seed):
    columns, logits = columns_and_logits(seed, ties=False)
    sampling = SamplingParams(max_new_tokens=8, temperature=0.0)
    narrow = run_in_lockstep(
        [tree_steps(draft_distribution(logits[0][:1], sampling), 4, 12, 3, Request(sampling), columns)],
        lambda asking, questions: [draft_distribution(rows, sampling) for rows in answered(logits[1:], None)(
            asking, questions)])[0]
    wide = run_in_lockstep(
        [tree_steps(draft_distribution(columns.widen(logits[0][:1]), sampling), 4, 12, 3, Request(sampling))],
        lambda asking, questions: [draft_distribution(rows, sampling) for rows in answered(logits[1:], columns)(
            asking, questions)])[0]
    assert narrow.tokens.tolist() == wide.tokens.tolist()
    assert narrow.parents == wide.parents
    assert len(narrow.tokens) > 3  # a tree, not a chain


def test_sampled_tree_refuses_columns():
    columns, logits = columns_and_logits(0)
    sampling = SamplingParams(max_new_tokens=8, temperature=0.8)
    routine = tree_steps(logits[0][:1].softmax(-1), 3, 6, 2, Request(sampling, rule=RejectionRule(None)), columns)
    with pytest.raises(ValueError, match="whole vocabulary"):
        next(routine)
