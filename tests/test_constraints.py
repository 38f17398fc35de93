"""Structured output under speculation (specdec.constraint, specdec.grammar): the constrained law is p masked to
the grammar's tokens; speculation keeps it exactly, greedy equals the target alone's constrained
greedy, forced tokens are drafted for free, and the matcher ends where the accepted text puts it."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from specdec import Constraint, SamplingParams, SpeculativeDecoder, logits_to_probs, make_drafter
from specdec.constraint import ConstraintError
from specdec.grammar import compiler_for
from specdec.models.base import LanguageModel
from law import assert_matches_law, sample_sequences
from table_lm import TableNetwork
from test_greedy_equality import DRAFT_KINDS, random_cases
from test_greedy_equality import lean_models  # noqa: F401 (a fixture)
from tiny import byte_level_tokenizer

EOS = 2
# ids 3-8 are the characters ' !"#$%'; "!" forces '"' and '#' after it.
LAW_REGEX = r'(!"#|\$)(%| |!"#)*'


def table_model_with_tokenizer(vocab: int, seed: int, sharpness: float = 1.5) -> LanguageModel:
    return LanguageModel(network=TableNetwork(vocab, seed, sharpness), tokenizer=byte_level_tokenizer(vocab),
                         name=f"table-{seed}", vocab_size=vocab, max_context=64, eos_token_ids=(EOS,))


def constrained_law(target: LanguageModel, prompt: list[int], length: int, sampling: SamplingParams) -> dict:
    """Every constrained continuation of the table model and its probability: p masked by a fresh
    matcher fed the prefix, then the sampling processors; a sequence ends at EOS or at ``length``."""
    law: dict[tuple[int, ...], float] = {}

    def walk(sequence: list[int], probability: float) -> None:
        if len(sequence) == length or (sequence and sequence[-1] == EOS):
            law[tuple(sequence)] = law.get(tuple(sequence), 0.0) + probability
            return
        matcher = compiler_for(target).matcher(sampling.constraint)
        matcher.consume(sequence)
        logits = target.network.logits(prompt + sequence).clone()
        logits[~matcher.allowed()] = float("-inf")
        probs = logits_to_probs(logits[None], sampling)[0]
        for token in probs.nonzero().flatten().tolist():
            walk(sequence + [token], probability * float(probs[token]))

    walk([], 1.0)
    return law


@pytest.mark.slow
@pytest.mark.parametrize("drafter_kind", ["none", "model", "ngram", "tree", "model-no-forced"])
def test_constrained_sampling_has_exactly_the_masked_law(drafter_kind):
    """8k seeded 4-token samples against the enumerated constrained law (temperature and top-k,
    q unmasked: the draft model proposes tokens the grammar refuses, which the masked p rejects).
    Mutation checked: masking only each block's first row (not the rows after drafted tokens)
    fails every case, "none" too (its forced drafts' rows go unmasked)."""
    vocab, length, samples = 9, 4, 8000
    target = table_model_with_tokenizer(vocab, seed=100)
    sampling = SamplingParams(temperature=0.9, top_k=5, constraint=Constraint.regex(LAW_REGEX))
    draft = table_model_with_tokenizer(vocab, seed=101, sharpness=1.0)
    drafter = {"none": None, "model": make_drafter("model", draft), "ngram": make_drafter("ngram", max_n=2),
               "tree": make_drafter("tree", draft, tree_budget=5),
               "model-no-forced": make_drafter("model", draft)}[drafter_kind]
    decoder = SpeculativeDecoder(target, drafter, gamma=3)
    decoder.engine.draft_forced = drafter_kind != "model-no-forced"
    prompt = [3, 4, 5, 6, 3, 4, 5]
    law = constrained_law(target, prompt, length, sampling)
    ended = [sequence for sequence in law if sequence[-1] == EOS]
    assert ended and all(re.fullmatch(LAW_REGEX, target.tokenizer.decode(sequence[:-1])) for sequence in ended)
    # Seeds from 100000: torch's generators seeded 0..16000 draw this law's second token ('$' then
    # the end, p = 0.0403) 0.0335 of the time by plain torch.multinomial (-4.0 sd; 0.0402 for seeds
    # 100000..200000), measured outside the engine, which draws exactly those multinomials.
    counts, accepted, drafted = sample_sequences(decoder, prompt, sampling, length, samples, first_seed=100000)
    assert_matches_law(counts, law, drafter_kind)
    if drafter_kind in ("model", "tree", "model-no-forced"):
        assert 0 < accepted < drafted


def char_model(model: LanguageModel) -> LanguageModel:
    """A tiny test model with a tokenizer the grammar engine reads (same ids as its char tokenizer)."""
    return dataclasses.replace(model, tokenizer=byte_level_tokenizer(model.vocab_size), eos_token_ids=(EOS,))


def reference_constrained_greedy(target: LanguageModel, prompt: list[int], constraint: Constraint,
                                 max_new_tokens: int) -> list[int]:
    """The obviously correct loop: the whole context through the target each token, a fresh
    matcher fed everything generated, the masked argmax."""
    generated: list[int] = []
    while len(generated) < max_new_tokens:
        matcher = compiler_for(target).matcher(constraint)
        matcher.consume(generated)
        ids = torch.tensor(prompt + generated)
        logits = target.extend(ids, target.new_cache())[-1].clone()
        logits[~matcher.allowed()] = float("-inf")
        generated.append(int(logits.argmax()))
        if generated[-1] == EOS:
            break
    return generated


GREEDY_CONSTRAINTS = [Constraint.regex(r"[a-f]{2,5}( [0-9]+)*;"), Constraint.regex(r'(abc|d[0-9]{3}|"e")+'),
                      Constraint.grammar('start: "(" item ("," item)* ")"\nitem: /[a-z]+/ | start')]


def test_constrained_greedy_equals_the_reference_loop(lean_models):  # noqa: F811
    target, _ = lean_models
    target = char_model(target)
    for index, (prompt, max_new_tokens, _) in enumerate(random_cases(3, target.vocab_size, count=6)):
        constraint = GREEDY_CONSTRAINTS[index % len(GREEDY_CONSTRAINTS)]
        expected = reference_constrained_greedy(target, prompt, constraint, max_new_tokens)
        result = SpeculativeDecoder(target).generate(prompt, SamplingParams(max_new_tokens=max_new_tokens,
                                                                            constraint=constraint))
        assert result.token_ids == expected


@pytest.mark.slow
@pytest.mark.parametrize("drafter_kind", ["model", "ngram", "tree", "staged"])
def test_constrained_greedy_speculation_equals_the_target_alone(lean_models, drafter_kind):  # noqa: F811
    """Over the random prompts, with drafts that always, never and partly agree: the same tokens as
    the target alone under the same constraint (no drafter, forced tokens not drafted)."""
    target, drafts = lean_models
    target = char_model(target)
    baseline = SpeculativeDecoder(target)
    baseline.engine.draft_forced = False
    accepted = {kind: 0 for kind in DRAFT_KINDS}
    for index, (prompt, max_new_tokens, gamma) in enumerate(random_cases(5, target.vocab_size, count=60)):
        sampling = SamplingParams(max_new_tokens=max_new_tokens,
                                  constraint=GREEDY_CONSTRAINTS[index % len(GREEDY_CONSTRAINTS)])
        expected = baseline.generate(prompt, sampling)
        for kind in DRAFT_KINDS:
            drafter = make_drafter(drafter_kind, char_model(drafts[kind]), max_n=2, tree_budget=6)
            result = SpeculativeDecoder(target, drafter, gamma=gamma).generate(prompt, sampling)
            assert result.token_ids == expected.token_ids, (drafter_kind, kind, prompt, gamma)
            accepted[kind] += result.stats.accepted
    if drafter_kind != "ngram":
        assert accepted["same"] > accepted["independent"]


def test_forced_tokens_are_drafted_for_free_and_change_nothing():
    target = table_model_with_tokenizer(9, seed=100)
    sampling = SamplingParams(max_new_tokens=12, constraint=Constraint.regex(LAW_REGEX))
    plain = SpeculativeDecoder(target)
    plain.engine.draft_forced = False
    forced = SpeculativeDecoder(target)
    forced_tokens = 0
    for prompt in ([3, 4], [5, 6, 7], [8], [4, 4, 8], [6, 5]):
        without, with_forced = plain.generate(prompt, sampling), forced.generate(prompt, sampling)
        assert with_forced.token_ids == without.token_ids
        assert with_forced.stats.drafted == 0  # forced tokens are counted apart from a drafter's guesses
        assert with_forced.stats.target_forwards == without.stats.target_forwards - with_forced.stats.forced_tokens
        forced_tokens += with_forced.stats.forced_tokens
    assert forced_tokens > 0


def test_the_matcher_ends_where_the_accepted_tokens_put_it():
    """Step by step, with drafts rejected part-way (an independent draft model, sampled): the
    request's matcher allows and forces what a fresh matcher fed the accepted tokens does.
    Mutation checked: skipping the rollback in masks_along fails at the first drafted step."""
    target = table_model_with_tokenizer(9, seed=100)
    draft = table_model_with_tokenizer(9, seed=101, sharpness=1.0)
    decoder = SpeculativeDecoder(target, make_drafter("model", draft), gamma=4)
    decoder.engine.draft_forced = False
    engine, rejected = decoder.engine, 0
    for seed in range(20):
        sampling = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=20, sampling_rule="rejection",
                                  constraint=Constraint.regex(LAW_REGEX))
        request = engine.new_request([3, 4, 5], sampling, row=0)
        cache = target.new_cache()
        engine.prefill([request], cache)
        while request.finish_reason is None:
            outcome = engine.step([request], cache)[0]
            rejected += outcome.num_accepted < outcome.num_drafted
            if request.finish_reason is None:
                fresh = compiler_for(target).matcher(sampling.constraint)
                fresh.consume(request.generated_ids)
                assert torch.equal(request.matcher.allowed(), fresh.allowed())
                assert request.matcher.forced() == fresh.forced()
    assert rejected > 0


def test_refused_constraints_name_the_problem():
    target = table_model_with_tokenizer(9, seed=100)
    decoder = SpeculativeDecoder(target)
    with pytest.raises(ConstraintError, match="unclosed character class"):
        decoder.generate([3], SamplingParams(constraint=Constraint.regex("[")))
    with pytest.raises(ConstraintError, match="not valid JSON"):
        decoder.generate([3], SamplingParams(constraint=Constraint("json_schema", "{oops")))
    with pytest.raises(ConstraintError, match="kind must be one of"):
        Constraint("xml")


def test_a_json_schema_constraint_gives_valid_json_with_the_bundled_pair():
    from specdec import load
    from specdec.defaults import default_model

    jsonschema = pytest.importorskip("jsonschema")
    target, draft = load(str(default_model("target"))), load(str(default_model("draft")))
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "count"],
              "properties": {"name": {"type": "string", "maxLength": 10},
                             "count": {"type": "integer", "minimum": 1, "maximum": 99}}}
    sampling = SamplingParams(max_new_tokens=60, constraint=Constraint.json_schema(schema))
    alone = SpeculativeDecoder(target).generate("def f(x):", sampling)
    jsonschema.validate(json.loads(alone.text), schema)
    spec = SpeculativeDecoder(target, make_drafter("model", draft), gamma=4).generate("def f(x):", sampling)
    assert spec.token_ids == alone.token_ids
    assert spec.stats.forced_tokens > 0
