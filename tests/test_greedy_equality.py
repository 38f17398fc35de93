"""Greedy speculative output is token-identical to target-only greedy decoding."""

import random

import pytest

from specdec import SpeculativeDecoder, load

DRAFT_KINDS = ("same", "independent", "perturbed")  # always, never and partly agreeing drafts
NUM_PROMPTS = 200


@pytest.fixture(scope="module", params=["specdec", "transformers"])
def loaded(request, tiny_pair):
    # float64 so that a k-token block and k single-token forwards never flip an argmax tie.
    load_one = lambda path: load(path, dtype="float64", backend=request.param)  # noqa: E731
    return load_one(tiny_pair["target"]), {kind: load_one(tiny_pair[kind]) for kind in DRAFT_KINDS}


def random_cases(seed: int, vocab_size: int):
    rng = random.Random(seed)
    for _ in range(NUM_PROMPTS):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 12))]
        yield prompt, rng.randint(1, 24), rng.randint(1, 8)


def test_greedy_speculation_equals_target_only(loaded):
    target, drafts = loaded
    baseline = SpeculativeDecoder(target)
    decoders = {kind: {g: SpeculativeDecoder(target, drafts[kind], gamma=g) for g in range(1, 9)} for kind in DRAFT_KINDS}
    accepted = {kind: 0 for kind in DRAFT_KINDS}
    drafted = {kind: 0 for kind in DRAFT_KINDS}
    for prompt, max_new_tokens, gamma in random_cases(seed=7, vocab_size=target.vocab_size):
        expected = baseline.generate(prompt, max_new_tokens=max_new_tokens)
        assert expected.stats.tau == 1.0
        for kind in DRAFT_KINDS:
            result = decoders[kind][gamma].generate(prompt, max_new_tokens=max_new_tokens)
            assert result.token_ids == expected.token_ids, (kind, prompt, max_new_tokens, gamma)
            assert result.finish_reason == expected.finish_reason
            accepted[kind] += result.stats.accepted
            drafted[kind] += result.stats.drafted
    # The three drafts really cover always / never / partly agreeing.
    assert accepted["same"] == drafted["same"] > 0
    assert accepted["independent"] < 0.2 * drafted["independent"]
    assert 0 < accepted["perturbed"] < drafted["perturbed"]
    assert accepted["perturbed"] > accepted["independent"]


def test_stream_chunks_add_up_to_the_result(loaded):
    target, drafts = loaded
    decoder = SpeculativeDecoder(target, drafts["perturbed"], gamma=4)
    chunks = list(decoder.stream([5, 6, 7], max_new_tokens=30))
    result = chunks[-1].result
    assert result is not None and all(chunk.result is None for chunk in chunks[:-1])
    assert [t for chunk in chunks for t in chunk.token_ids] == result.token_ids
    assert "".join(chunk.text for chunk in chunks) == result.text
    sources = [s.value for chunk in chunks for s in chunk.sources]
    assert len(sources) == len(result.token_ids)
    # every chunk ends with exactly one token of the target's own
    for chunk in chunks[:-1]:
        assert [s.value for s in chunk.sources[:-1]] == ["draft"] * (len(chunk.sources) - 1)
        assert chunk.sources[-1].value in ("correction", "bonus")
