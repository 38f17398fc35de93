"""The public samplers validate what they are given: malformed input is a ValueError naming the
argument, never a silently wrong law.

Mutation check (done 2026-11-22): with the normalization check switched off
(NORMALIZATION_TOLERANCE = 1e9 in specdec/core/verify.py) the property test below fails: hypothesis
finds unnormalized rows that are accepted and change the first token's law."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from specdec import rejection_sample, tree_rejection_sample
from specdec.core.verify import acceptance_probs, residual_distribution

P = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]])
Q = torch.tensor([[0.6, 0.3, 0.1]])
TOKEN = torch.tensor([0])

MALFORMED = [
    ("unnormalized q", TOKEN, Q * 3, P, "draft_probs rows must sum to 1"),
    ("logits as q", TOKEN, torch.log(Q), P, "draft_probs holds negative values"),
    ("logits as p", TOKEN, Q, torch.log(P), "target_probs holds negative values"),
    ("NaN in q", TOKEN, torch.tensor([[float("nan"), 0.5, 0.5]]), P, "draft_probs holds NaN"),
    ("inf in p", TOKEN, Q, torch.tensor([[float("inf"), 0.0, 0.0], [0.2, 0.2, 0.6]]), "target_probs holds NaN or inf"),
    ("more q rows than tokens", TOKEN, torch.cat([Q, Q]), P, "draft_probs must have shape"),
    ("p and q over different vocabularies", TOKEN, torch.tensor([[0.5, 0.5]]), P, "one vocabulary"),
    ("a token q could not draw", torch.tensor([2]), torch.tensor([[0.5, 0.5, 0.0]]), P, "probability 0"),
    ("a token outside the vocabulary", torch.tensor([7]), Q, P, "token ids in"),
    ("float draft tokens", torch.tensor([0.0]), Q, P, "integer tensor"),
    ("p without the bonus row", TOKEN, Q, P[:1], "needs gamma"),
]


@pytest.mark.parametrize("case", MALFORMED, ids=[case[0] for case in MALFORMED])
def test_malformed_input_is_a_one_line_value_error(case):
    _, tokens, draft_probs, target_probs, message = case
    with pytest.raises(ValueError, match=message) as error:
        rejection_sample(tokens, draft_probs, target_probs, torch.Generator().manual_seed(0))
    assert "\n" not in str(error.value)


def test_tree_inputs_are_checked_too():
    tokens, p = torch.tensor([0, 1]), torch.tensor([[0.5, 0.5, 0.0]] * 3)
    with pytest.raises(ValueError, match="parents must list"):
        tree_rejection_sample(tokens, [1, -1], None, p)
    with pytest.raises(ValueError, match="draft_probs rows must sum to 1"):
        tree_rejection_sample(tokens, [-1, -1], torch.tensor([[2.0, 1.0, 0.0]] * 3), p)
    # q after a leaf is never read: any values there are fine
    emitted, _ = tree_rejection_sample(tokens, [-1, -1], torch.tensor([[0.5, 0.5, 0.0], [0, 0, 0], [0, 0, 0]]), p)
    assert emitted.shape[0] >= 1


def first_token_law(draft_probs: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """The exact law of rejection_sample's first emitted token with one drafted token x ~ q:
    q(y) a(y) (x = y accepted) plus the rejection mass times the residual."""
    q, p = draft_probs[0].double(), target_probs[0].double()
    vocab = q.shape[0]
    accept = acceptance_probs(torch.arange(vocab), q.expand(vocab, vocab), p.expand(vocab + 1, vocab)).double()
    rejected_mass = float((q * (1 - accept)).sum())
    return q * accept + rejected_mass * residual_distribution(q[None], p[None])[0].double()


def maybe_distribution(vocab: int, rows: int):
    """Arbitrary float rows (NaN, inf, negative, unnormalized...) or, half the time, proper
    distributions: so that both branches of the property are exercised."""
    raw = arrays(np.float32, (rows, vocab), elements=st.floats(-2, 5, width=32) | st.sampled_from(
        [float("nan"), float("inf"), 0.0]))
    proper = arrays(np.float32, (rows, vocab), elements=st.floats(0.0625, 1, width=32)).map(
        lambda a: a / a.sum(-1, keepdims=True))
    return st.one_of(raw, proper).map(torch.from_numpy)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), vocab=st.integers(2, 5))
def test_rejection_sample_raises_or_keeps_the_law(data, vocab):
    draft_probs = data.draw(maybe_distribution(vocab, 1))
    target_probs = data.draw(maybe_distribution(vocab, 2))
    token = torch.tensor([data.draw(st.integers(0, vocab - 1))])
    try:
        emitted = rejection_sample(token, draft_probs, target_probs, torch.Generator().manual_seed(0))
    except ValueError:
        return
    assert 1 <= emitted.shape[0] <= 2 and 0 <= int(emitted.min()) and int(emitted.max()) < vocab
    # accepted input: the first token's law is p (up to the normalization tolerance)
    assert torch.allclose(first_token_law(draft_probs, target_probs), target_probs[0].double(), atol=5e-3)
