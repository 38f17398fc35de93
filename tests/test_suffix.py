"""Suffix decoding: guesses copied from this request's text and from a bounded cache of earlier
outputs are verified as point masses, so greedy output equals target-only output and sampled
output keeps the target's law, whatever the cache holds."""

import random

import pytest
import torch
from law import assert_matches_law, sample_sequences
from table_lm import table_model
from test_distribution import PROMPT, exact_sequence_law
from test_greedy_equality import check_equality, lean_models  # noqa: F401 (fixture)

from specdec import SamplingParams, SpeculativeDecoder, make_drafter
from specdec.drafting.suffix import SuffixCache, SuffixDrafter, SuffixIndex, tree_of, trie_draft


def test_trie_draft_worked_example():
    continuations = [[1, 2, 3], [1, 2, 4], [1, 5], [1, 2, 3]]
    # counts: 1 -> 4, (1, 2) -> 3, (1, 2, 3) -> 2, (1, 5) -> 1, (1, 2, 4) -> 1
    assert tree_of(trie_draft(continuations, 3, chain=True)) == ([1, 2, 3], [-1, 0, 1])
    tokens, parents = tree_of(trie_draft(continuations, 4, chain=False))
    assert tokens == [1, 2, 3, 5] and parents == [-1, 0, 1, 0]  # the 4 most frequent nodes
    assert trie_draft([], 4, chain=False) == []


def test_the_index_finds_the_longest_earlier_suffix_and_forgets_dropped_sequences():
    index = SuffixIndex(max_n=3)
    index.extend(0, [7, 1, 2, 3, 9])
    index.extend(1, [5, 2, 3, 8])
    assert index.match([4, 1, 2, 3], limit=2) == (3, [[9]])  # "1 2 3" only in sequence 0
    assert index.match([4, 2, 3], limit=2) == (2, [[8], [9]])  # newest occurrence first
    assert index.match([4, 2, 3], limit=2, exclude=1) == (2, [[9]])
    index.drop(0)
    assert index.match([4, 1, 2, 3], limit=2) == (2, [[8]]) and index.total_tokens == 4
    assert index.match([6], limit=2) == (0, [])


def test_the_cache_stays_under_its_cap_under_a_stream_of_distinct_requests():
    target = table_model(6, seed=100)
    drafter = SuffixDrafter(SuffixCache(max_tokens=60))
    decoder = SpeculativeDecoder(target, drafter, gamma=4)
    rng = random.Random(0)
    for _ in range(30):
        decoder.generate([rng.randrange(6) for _ in range(5)], max_new_tokens=20)
        assert 0 < drafter.cache.size_tokens <= 60
    assert len(drafter.cache._order) < 30  # the oldest left
    assert SuffixCache(max_tokens=0).new_sequence([1, 2]) is None  # off


def test_a_second_identical_request_is_drafted_from_the_cache():
    """The first request's output is in the cache: the second drafts it whole (tau near gamma + 1),
    where a cold drafter on the same prompt guesses from the prompt alone."""
    target = table_model(12, seed=3, max_context=128)
    prompt, gamma = [0, 1, 2, 3, 4, 5, 6], 4
    warm = SpeculativeDecoder(target, make_drafter("suffix"), gamma=gamma)
    first = warm.generate(prompt, max_new_tokens=60)
    second = warm.generate(prompt, max_new_tokens=60)
    cold = SpeculativeDecoder(target, make_drafter("suffix"), gamma=gamma).generate(prompt, max_new_tokens=60)
    assert second.token_ids == first.token_ids == cold.token_ids
    assert second.stats.tau >= gamma and second.stats.tau > cold.stats.tau + 1


@pytest.mark.parametrize("kind", ["suffix", "suffix-tree", "suffix+ngram", "suffix-or-ngram"])
def test_tokens_from_the_cache_are_counted_and_marked(kind):
    """What --show and the stats call "cache": accepted guesses that only earlier requests' outputs
    supplied. The first request has none; the second, identical one copies from the cache, and
    its stream marks exactly the tokens its stats count."""
    from specdec.text import TokenSource

    target = table_model(12, seed=3, max_context=128)
    prompt = [0, 1, 2, 3, 4, 5, 6]
    decoder = SpeculativeDecoder(target, make_drafter(kind, tree_budget=6), gamma=4)
    first = decoder.generate(prompt, max_new_tokens=60)
    assert first.stats.drafted_from_cache == first.stats.accepted_from_cache == 0
    chunks = list(decoder.stream(prompt, SamplingParams(max_new_tokens=60)))
    second = chunks[-1].result
    assert second is not None and second.token_ids == first.token_ids
    marked = sum(source == TokenSource.CACHE for chunk in chunks for source in chunk.sources)
    assert 0 < marked == second.stats.accepted_from_cache <= second.stats.drafted_from_cache
    assert second.stats.accepted_from_cache <= second.stats.accepted


def test_a_guess_the_request_s_own_text_also_makes_is_not_owed_to_the_cache():
    from specdec.core.drafts import ContextRequest

    drafter = make_drafter("suffix")
    drafter.cache.append(drafter.cache.new_sequence([]), [1, 2, 3, 7, 8])  # an earlier output
    own_repeat = torch.tensor([5, 1, 2, 3, 7, 9, 1, 2, 3])  # "1 2 3 7" also in this request's own text
    draft = drafter.propose(ContextRequest.started(drafter, own_repeat), 3)
    assert draft.tokens.tolist()[:1] == [7] and draft.from_cache is not None and not draft.from_cache[0]
    only_cache = torch.tensor([5, 1, 2, 3])
    draft = drafter.propose(ContextRequest.started(drafter, only_cache), 3)
    assert draft.tokens.tolist() == [7, 8] and draft.from_cache == (True, True)
    assert draft.truncated(1).from_cache == (True,)


@pytest.mark.slow
def test_suffix_drafters_equal_target_only(lean_models):  # noqa: F811
    """200 random prompts (half with repeats) through one drafter each, so every prompt after the
    first drafts with a warm cache of the earlier ones' outputs; and with the cache off."""
    target, drafts = lean_models
    drafters = {"suffix": make_drafter("suffix"), "suffix-tree": make_drafter("suffix-tree"),
                "no cache": SuffixDrafter(SuffixCache(max_tokens=0)), "suffix+ngram": make_drafter("suffix+ngram"),
                "suffix-or-staged": make_drafter("suffix-or-staged", drafts["perturbed"], max_n=2)}
    counts = check_equality(target, drafters, "fixed")
    assert all(accepted > 0 for accepted, _ in counts.values())
    assert counts["suffix"][0] > counts["no cache"][0]  # the cache found more


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["suffix", "suffix-tree", "suffix-or-model"])
def test_suffix_law_of_three_tokens(kind):
    """10k seeded 3-token samples from one decoder (its cache fills with the earlier samples, so
    the drafts depend on them) against the enumerated target law; suffix-or-model switches between
    point-mass guesses and the draft model's q by the match, step by step."""
    vocab, length, samples = 6, 3, 10000
    sampling = SamplingParams(temperature=0.9)
    target = table_model(vocab, seed=100)
    draft = table_model(vocab, seed=101, sharpness=1.0)
    decoder = SpeculativeDecoder(target, make_drafter(kind, draft, tree_budget=6), gamma=3)
    law = exact_sequence_law(target, PROMPT, length, sampling)
    counts, accepted, drafted = sample_sequences(decoder, PROMPT, sampling, length, samples)
    assert 0 < accepted < drafted
    assert_matches_law(counts, law)


def test_the_cache_size_is_an_option_and_zero_turns_it_off():
    drafter = make_drafter("suffix+ngram", suffix_cache_tokens=0)
    suffix = next(d for d in drafter.drafters if isinstance(d, SuffixDrafter))
    assert suffix.cache.max_tokens == 0
    target = table_model(12, seed=3, max_context=128)
    decoder = SpeculativeDecoder(target, suffix, gamma=4)
    decoder.generate([0, 1, 2, 3], max_new_tokens=30)
    assert suffix.cache.size_tokens == 0


def test_suffix_or_model_takes_the_suffix_draft_only_where_the_match_is_long():
    from specdec.core.drafts import ContextRequest
    from specdec.drafting.suffix import SuffixFirstDrafter

    draft = table_model(12, seed=4)
    drafter = make_drafter("suffix-or-model", draft)
    assert isinstance(drafter, SuffixFirstDrafter) and drafter.min_match == 4
    copying = torch.tensor([1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5])  # "1 2 3 4 5" seen before, then 9
    proposal = drafter.propose(ContextRequest.started(drafter, copying), 3)
    assert proposal.tokens.tolist() == [9, 1, 2] and proposal.probs is None  # copied: point masses
    fresh = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 10, 11])  # no repeat: the draft model's q
    sampled = SamplingParams(temperature=1.0)
    proposal = drafter.propose(ContextRequest.started(drafter, fresh, sampling=sampled), 3)
    assert proposal.probs is not None and proposal.num_nodes == 3
