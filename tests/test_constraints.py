"""Structured output under speculation (specdec.constraint, specdec.grammar): the constrained law is p masked to
the grammar's tokens; speculation keeps it exactly, greedy equals the target alone's constrained
greedy, forced tokens are drafted for free, and the matcher ends where the accepted text puts it."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from law import assert_matches_law, sample_sequences
from table_lm import TableNetwork
from test_greedy_equality import (
    DRAFT_KINDS,
    lean_models,  # noqa: F401 (a fixture)
    random_cases,
)
from tiny import byte_level_tokenizer

from specdec import Constraint, SamplingParams, SpeculativeDecoder, logits_to_probs, make_drafter
from specdec.constraint import ConstraintError
from specdec.grammar import compiler_for
from specdec.models.base import LanguageModel

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


class FixedQDrafter:
    """Draws its chain from one fixed q that no grammar masks: drafts the grammar often refuses
    (what core.engine.fit_draft cuts just after the first refused token)."""

    hidden_layers = ()

    def __init__(self, q: torch.Tensor) -> None:  # q [vocab]
        self.q, self.vocab_size = q, q.shape[-1]

    def start(self, prompt_ids):
        return None

    def propose(self, request, gamma):
        from specdec import Draft

        first = request.context.shape[0]
        probs = self.q[None].expand(gamma, -1).clone()  # [gamma, vocab]
        return Draft(request.rule.draw(probs, range(first, first + gamma)), probs)

    def observe(self, request, outcome):
        pass


@pytest.mark.slow
@pytest.mark.parametrize("drafter_kind", ["none", "model", "ngram", "tree", "model-no-forced", "unmasked-q"])
def test_constrained_sampling_has_exactly_the_masked_law(drafter_kind):
    """8k seeded 4-token samples against the enumerated constrained law (temperature and top-k,
    q unmasked: the draft model proposes tokens the grammar refuses, which the masked p rejects).
    Mutation checked: masking only each block's first row (not the rows after drafted tokens)
    fails every case, "none" too (its forced drafts' rows go unmasked); cutting a q-draft before
    its first refused token instead of just after it (fit_draft) fails "unmasked-q"."""
    vocab, length, samples = 9, 4, 8000
    target = table_model_with_tokenizer(vocab, seed=100)
    sampling = SamplingParams(temperature=0.9, top_k=5, constraint=Constraint.regex(LAW_REGEX))
    draft = table_model_with_tokenizer(vocab, seed=101, sharpness=1.0)  # its chains mask q (draft_chain)
    drafter = {"none": None, "model": make_drafter("model", draft), "ngram": make_drafter("ngram", max_n=2),
               "tree": make_drafter("tree", draft, tree_budget=5),
               "model-no-forced": make_drafter("model", draft),
               "unmasked-q": FixedQDrafter(torch.tensor([0.02, 0.02, 0.16, 0.2, 0.2, 0.1, 0.1, 0.1, 0.1])),
               }[drafter_kind]
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
    if drafter_kind in ("model", "tree", "model-no-forced", "unmasked-q"):
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
        assert with_forced.stats.grammar_seconds > 0
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


# --- every output valid: hypothesis-generated JSON schemas, regexes; the bundled pair ---------------

DRAFTERS = ("none", "model", "ngram", "tree", "staged", "suffix")


@pytest.fixture(scope="module")
def bundled_pair():
    from specdec import load
    from specdec.defaults import default_model

    return load(str(default_model("target"))), load(str(default_model("draft")))


def bundled_decoder(pair, kind: str) -> SpeculativeDecoder:
    target, draft = pair
    drafter = None if kind == "none" else make_drafter(kind, None if kind in ("ngram", "suffix") else draft,
                                                       target=target)
    return SpeculativeDecoder(target, drafter, gamma=4)


def json_schemas():
    from hypothesis import strategies as st

    names = st.text("abcdefgh_", min_size=1, max_size=6)
    bounds = st.tuples(st.integers(-50, 50), st.integers(0, 60)).map(lambda b: (b[0], b[0] + b[1]))
    leaves = st.one_of(
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
        bounds.map(lambda b: {"type": "integer", "minimum": b[0], "maximum": b[1]}),
        bounds.map(lambda b: {"type": "number", "minimum": b[0], "maximum": b[1]}),
        st.just({"type": "boolean"}),
        st.lists(st.text("xyz", min_size=1, max_size=3), min_size=1, max_size=4, unique=True).map(
            lambda values: {"enum": values}),
    )

    def objects(children):
        return st.dictionaries(names, children, min_size=1, max_size=4).map(
            lambda props: {"type": "object", "properties": props, "required": sorted(props),
                           "additionalProperties": False})

    def arrays(children):
        return st.builds(lambda items, most: {"type": "array", "items": items, "maxItems": most},
                         children, st.integers(0, 3))

    return objects(st.recursive(leaves, lambda children: st.one_of(objects(children), arrays(children)),
                                max_leaves=6))


@pytest.mark.slow
@pytest.mark.parametrize("kind", DRAFTERS)
def test_every_output_matches_its_json_schema(bundled_pair, kind):
    """Hypothesis schemas (objects, arrays, enums, nested, bounded numbers), greedy and sampled:
    every output parses and validates with jsonschema."""
    from hypothesis import HealthCheck, given, settings

    jsonschema = pytest.importorskip("jsonschema")
    decoder = bundled_decoder(bundled_pair, kind)

    @settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(schema=json_schemas())
    def check(schema):
        for temperature, seed in ((0.0, None), (0.8, 3)):
            sampling = SamplingParams(temperature=temperature, seed=seed, max_new_tokens=400,
                                      constraint=Constraint.json_schema(schema))
            result = decoder.generate("Data as JSON:", sampling)
            assert result.finish_reason == "eos", (result.finish_reason, result.text)
            jsonschema.validate(json.loads(result.text), schema)

    check()


REGEXES = [r"[a-z]{2,6}(, [a-z]{2,6}){0,3}\.", r"(0|[1-9][0-9]{0,3})( [+*-] (0|[1-9][0-9]{0,3})){1,3}",
           r"def [a-z_]{1,10}\((x|y)?\):"]


@pytest.mark.parametrize("kind", DRAFTERS)
def test_regex_outputs_fullmatch(bundled_pair, kind):
    decoder = bundled_decoder(bundled_pair, kind)
    for pattern in REGEXES:
        for temperature, seed in ((0.0, None), (0.9, 1)):
            sampling = SamplingParams(temperature=temperature, seed=seed, max_new_tokens=80,
                                      constraint=Constraint.regex(pattern))
            result = decoder.generate("def f(x):\n    return", sampling)
            assert result.finish_reason == "eos" and re.fullmatch(pattern, result.text), (pattern, result.text)


class FixedDrafter:
    """Always drafts the same tokens as point masses (a drafter is free to guess anything)."""

    vocab_size = None
    hidden_layers = ()

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def start(self, prompt_ids):
        return None

    def propose(self, request, gamma):
        from specdec import Draft

        return Draft(torch.tensor(self.tokens[:gamma]))

    def observe(self, request, outcome):
        pass


def test_a_draft_that_goes_on_after_the_end_token_is_verified_and_cut_there():
    """'$', the end token, then more: verified as usual and cut at the end token, greedy and
    sampled (the end token in the middle of a draft is where a grammar's look-ahead stops)."""
    target = table_model_with_tokenizer(9, seed=100)
    decoder = SpeculativeDecoder(target, FixedDrafter([7, EOS, 3, 3]), gamma=4, draft_forced=False)
    texts = set()
    for seed in range(30):
        for temperature in (0.0, 1.0):
            result = decoder.generate([3, 4], SamplingParams(temperature=temperature, seed=seed, max_new_tokens=8,
                                                             constraint=Constraint.regex(r"[$!]")))
            assert result.finish_reason == "eos" and result.token_ids[-1] == EOS
            texts.add(result.text)
    assert texts == {"$", "!"}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_model_drafts_only_what_the_grammar_allows_and_leaves_the_matcher_alone(temperature):
    """q masked along the chain: every drafted token is allowed; the matcher is where it was.
    Mutation checked: without mask_draft_logits in draft_chain the first assertion fails."""
    from specdec.core.drafts import ContextRequest

    target = table_model_with_tokenizer(9, seed=100)
    drafter = make_drafter("model", table_model_with_tokenizer(9, seed=101, sharpness=1.0))
    refused_unmasked = 0
    for seed in range(20):
        matcher = compiler_for(target).matcher(Constraint.regex(LAW_REGEX))
        sampling = SamplingParams(temperature=temperature, seed=seed)
        context = torch.tensor([3, 4, 5, 6, 3][: 1 + seed % 5])
        before = matcher.allowed()
        request = ContextRequest.started(drafter, context, sampling=sampling, matcher=matcher,
                                         rule=SpeculativeDecoder(target).engine.new_request([3], sampling, 0).rule)
        tokens = drafter.propose(request, 5).tokens.tolist()
        assert matcher.valid_prefix(tokens) == len(tokens), tokens
        assert torch.equal(matcher.allowed(), before) and matcher.walked == 0
        free = drafter.propose(ContextRequest.started(drafter, context, sampling=sampling), 5).tokens.tolist()
        refused_unmasked += matcher.valid_prefix(free) < len(free)
    assert refused_unmasked > 0  # the draft model alone does propose refused tokens


def test_a_draft_vocabulary_without_an_allowed_token_keeps_its_q_and_a_complete_grammar_looks_no_further():
    """A head's logits are -inf outside its draft vocabulary: masking them to the grammar may leave
    nothing finite, and then q stays as it was (sampling from an all -inf row would fail). A
    complete grammar (only the end token left) takes no look-ahead step."""
    target = table_model_with_tokenizer(9, seed=100)
    matcher = compiler_for(target).matcher(Constraint.regex(r"\$"))
    logits = torch.full((1, 9), float("-inf"))
    logits[0, 4] = 1.0  # '!': the grammar allows only '$' (7) here
    assert torch.equal(matcher.mask_draft_logits(logits), logits)
    matcher.consume([7])
    assert not matcher.look_ahead(EOS) and matcher.walked == 0
