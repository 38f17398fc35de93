"""logits_to_probs applies the same processing as transformers' logits warpers."""

import pytest
import torch

from specdec import SamplingParams, logits_to_probs


def transformers_probs(logits, params):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0:
        warpers.append(MinPLogitsWarper(params.min_p))
    return warpers(None, logits.clone()).softmax(-1)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.9),
    SamplingParams(temperature=0.8, top_p=0.5),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.9, top_k=10, top_p=0.8, min_p=0.05),
])
def test_matches_transformers_warpers(params):
    torch.manual_seed(0)
    logits = 3 * torch.randn(16, 50)
    torch.testing.assert_close(logits_to_probs(logits, params), transformers_probs(logits, params), atol=1e-6, rtol=0)


def test_greedy_is_a_point_mass_on_the_argmax():
    logits = torch.randn(4, 10)
    probs = logits_to_probs(logits, SamplingParams(temperature=0))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.equal(probs.sum(-1), torch.ones(4))


@pytest.mark.parametrize("bad, message", [
    (dict(temperature=-1), "temperature"), (dict(top_k=-2), "top_k"), (dict(top_p=0), "top_p"),
    (dict(min_p=1.0), "min_p"),
])
def test_bad_parameters_are_named(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad)
