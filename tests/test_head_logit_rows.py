"""A head's output layer on chosen rows only (DraftHead.forward's logit_rows, what feeding a
backlog asks for): each chosen row's logits are bit for bit what the full forward gives it,
float32 (fixed-row blocks) and int8."""

import pytest
import torch

from specdec import load
from specdec.drafting.head_format import new_head
from specdec.models.base import Attention, Segment


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_logits_of_chosen_rows_equal_the_full_forwards(tiny_pair, quantize):
    target = load(tiny_pair["target"])
    torch.manual_seed(5)
    head = new_head(target)
    if quantize is not None:
        from specdec.models.precisions import quantize_linears

        quantize_linears(head, quantize)
    lengths = [7, 3, 11]  # three rows' backlogs, fed in one forward
    tokens = torch.randint(0, target.vocab_size, (sum(lengths),))
    features = torch.randn(sum(lengths), head.config.hidden_size)
    positions = torch.cat([torch.arange(length) for length in lengths])
    attention = Attention(tuple(Segment(row, length) for row, length in enumerate(lengths)), batch_invariant=True)
    last_rows = torch.tensor(attention.offsets[1:]) - 1
    full_logits, full_features = head(tokens, features, positions, head.new_cache(32, rows=3), attention)
    logits, out = head(tokens, features, positions, head.new_cache(32, rows=3), attention, logit_rows=last_rows)
    assert logits.shape == (3, head.config.draft_vocab_size)
    assert torch.equal(logits, full_logits[last_rows])
    assert torch.equal(out, full_features)
