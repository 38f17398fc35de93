"""ngram-edit: prompt lookup that learns the edits the output makes to the text it copies. The
pieces on worked examples; fewer steps than plain lookup on a rename (a simulated target that
copies with the change); greedy identity with the target alone on random prompts (lossless)."""

import random

import pytest
import torch
from test_greedy_equality import check_equality, lean_models  # noqa: F401 (fixture)

from specdec import make_drafter
from specdec.core.drafts import ContextRequest, StepOutcome
from specdec.core.verify import greedy_verify_tokens
from specdec.drafting.edits import Edit, apply_edits, learn_edit, undo_edits

NAME, VALUE = 10, 11  # "name" and the "_value" a rename appends to it


def test_learn_edit_finds_the_smallest_change_after_which_the_copy_agrees_again():
    source = [1, NAME, 2, 3, NAME, 4, 5]  # "(name) = name + 1"
    output = [1, NAME, VALUE, 2, 3, NAME]  # copied with the rename, so far
    tokens = source + [9] + output
    failed_at = len(source) + 1 + 2  # the copy drafted source[2] (")"), the target chose "_value"
    assert learn_edit(tokens, 2, failed_at) == Edit((NAME,), (NAME, VALUE))
    replaced = [1, 7, 2, 3, 4, 5] + [9] + [1, 8, 2, 3, 4]  # 7 became 8
    assert learn_edit(replaced, 1, 8) == Edit((1, 7), (1, 8))
    assert learn_edit([1, 2, 3, 4, 5, 9, 1, 6, 6, 6, 6, 6], 1, 7) is None  # no agreement within reach


def test_apply_and_undo():
    rename = Edit((NAME,), (NAME, VALUE))
    tokens, origins = apply_edits([1, NAME], [2, 3, NAME, 4], [rename])
    assert tokens == [VALUE, 2, 3, NAME, VALUE, 4] and origins == [None, 0, 1, 2, None, 3]
    assert apply_edits([1, NAME], [VALUE, 2], [rename]) == ([VALUE, 2], [0, 1])  # copied from edited text
    assert apply_edits([5], [1, 7, 2], [Edit((1, 7), (1, 8))]) == ([1, 8, 2], [0, None, 2])
    assert undo_edits([3, NAME, VALUE], [rename]) == [3, NAME]


def copy_steps(kind: str, prompt: list[int], truth: list[int], gamma: int = 6) -> int:
    """Target forwards a greedy target that writes ``truth`` needs with this drafter."""
    drafter = make_drafter(kind)
    request = ContextRequest.started(drafter, torch.tensor(prompt))
    steps = 0
    while len(request.context) < len(prompt) + len(truth):
        done = len(request.context) - len(prompt)
        draft = drafter.propose(request, gamma)
        target = torch.tensor(truth[done : done + draft.num_nodes + 1])
        target = torch.cat([target, target[-1:].repeat(draft.num_nodes + 1 - len(target))])
        emitted = greedy_verify_tokens(draft.tokens, target)[: len(truth) - done]
        request.context = torch.cat([request.context, emitted])
        drafter.observe(request, StepOutcome(emitted, draft.num_nodes))
        steps += 1
    assert request.context[len(prompt):].tolist() == truth
    return steps


def test_a_rename_is_learned_once_and_made_in_every_later_copy():
    rng = random.Random(0)
    body = []
    for _ in range(12):  # statements that each use the name once
        body += [rng.randrange(20, 60) for _ in range(5)] + [NAME] + [rng.randrange(20, 60) for _ in range(3)]
    renamed = [token for old in body for token in ((NAME, VALUE) if old == NAME else (old,))]
    prompt = body + [99]
    plain, editing = copy_steps("ngram", prompt, renamed), copy_steps("ngram-edit", prompt, renamed)
    assert editing < plain * 0.75, (editing, plain)


@pytest.mark.slow
def test_ngram_edit_equals_target_only(lean_models):  # noqa: F811
    target, _ = lean_models
    counts = check_equality(target, {"ngram-edit": make_drafter("ngram-edit")}, "fixed")
    assert counts["ngram-edit"][0] > 0
