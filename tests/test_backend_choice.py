"""The per-machine choice of how to run a model: the fastest candidate whose verify blocks are
exact here, measured once and cached (specdec/models/backend_choice.py)."""

import dataclasses

import pytest
import torch

from specdec.models.backend_choice import block_is_exact, choose_fastest_exact
from specdec.models.base import ForwardOutput
from specdec.models.loading import load


class BlockSkewed(torch.nn.Module):
    """A network whose logits depend on how many tokens share the forward: fast, and wrong."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, tokens, positions, cache, attention, want_logits=True, hidden_layers=()):
        out = self.inner(tokens, positions, cache, attention, want_logits, hidden_layers)
        return ForwardOutput(out.logits + 1e-3 * (tokens.shape[0] - 1), out.hidden)

    def new_cache(self, *args, **kwargs):
        return self.inner.new_cache(*args, **kwargs)


@pytest.mark.slow
def test_an_inexact_candidate_is_refused_and_the_choice_is_cached(tiny_pair, tmp_path, monkeypatch):
    """Mutation note: without the block_is_exact check the skewed candidate (timed as fastest
    below) is chosen and the first assertion fails."""
    from specdec.models import backend_choice

    exact = load(tiny_pair["target"])
    skewed = dataclasses.replace(exact, network=BlockSkewed(exact.network))
    assert block_is_exact(exact) and not block_is_exact(skewed)
    timings = {id(exact): 2.0, id(skewed): 1.0}
    monkeypatch.setattr(backend_choice, "forward_milliseconds", lambda model: timings[id(model)])
    loads = []
    candidates = {"exact": lambda: loads.append("exact") or exact, "skewed": lambda: loads.append("skewed") or skewed}
    cache_file = tmp_path / "choice.json"
    choice = choose_fastest_exact(candidates, "tiny", cache_file=cache_file)
    assert choice.name == "exact" and "not exact" in choice.refused["skewed"]
    assert "exact" in choice.line() and "skewed: verify blocks not exact here" in choice.line()
    assert choose_fastest_exact(candidates, "tiny", cache_file=cache_file).name == "exact"
    assert sorted(loads) == ["exact", "skewed"]  # the second call measured nothing


def test_with_no_exact_candidate_it_says_so(tiny_pair, tmp_path):
    exact = load(tiny_pair["target"])
    skewed = dataclasses.replace(exact, network=BlockSkewed(exact.network))
    with pytest.raises(RuntimeError, match="no exact way"):
        choose_fastest_exact({"skewed": lambda: skewed}, "tiny", cache_file=tmp_path / "choice.json")


def test_each_block_size_is_timed_after_its_first_use(tiny_pair, monkeypatch):
    """A model whose first forward of each block size is slow (a kernel's per-shape check, say)
    is timed at its steady speed. Mutation: warming up the one-token forward only (as before)
    times the first 5-token forward and fails."""
    from specdec.models import backend_choice

    model = load(tiny_pair["target"])
    seen: set[int] = set()

    def first_use_slow(model, cache, count, repeats):
        slow = count not in seen
        seen.add(count)
        return 1.0 if slow else 0.001  # seconds: the median of the repeats of that call

    monkeypatch.setattr(backend_choice, "time_block", first_use_slow)
    assert backend_choice.forward_milliseconds(model) == pytest.approx(2.0)
