"""Opt-in LOSSY acceptance (specdec.core.acceptance): its syntax, exact acceptance unchanged, each scheme
at its strictest setting equal to exact (greedy, rejection and coupled sampling; chains and trees;
alone and in a batch), relaxed settings really relaxing, and the verifiers' relaxed rule by hand."""

import dataclasses
import random

import pytest
import torch

from specdec import SamplingParams, SpeculativeDecoder, TokenSource, load, make_drafter
from specdec.core.acceptance import LOSSY_PRESET, Relaxation, parse_acceptance
from specdec.core.verify import greedy_tree_verify_tokens, greedy_verify_tokens, rejection_sample

PROMPTS = 16
MODES = {  # how a request samples: greedy, and the two sampling rules (seeded: the same draws every run)
    "greedy": SamplingParams(max_new_tokens=16),
    "rejection": SamplingParams(temperature=0.9, max_new_tokens=16, sampling_rule="rejection"),
    "coupled": SamplingParams(temperature=0.9, max_new_tokens=16, sampling_rule="coupled"),
}
# Each scheme's strictest settings: nothing is kept beyond what the exact test keeps. Greedy has more
# of them: its exact pick is the argmax, which topk with k = 1 and a bar of 0.5 only ever admit.
STRICTEST = {"greedy": ["topk:k=1,delta=0", "topk:k=1,delta=0.5", "topk:k=50,delta=1",
                        "typical:epsilon=0.5,alpha=inf", "typical:epsilon=1,alpha=inf"],
             "rejection": ["topk:k=50,delta=1", "typical:epsilon=1,alpha=inf"],
             "coupled": ["topk:k=50,delta=1", "typical:epsilon=1,alpha=inf"]}
LOOSE = "topk:k=10,delta=0"  # any of the target's 10 most likely tokens: relaxes a lot
# The sweeps below run in the slow tier; these cases stay in the fast one: greedy, where exact must
# equal the target alone, and the strictest case that two of the mutations below fail.
FAST_MODE, FAST_STRICTEST = "greedy", ("rejection", "typical:epsilon=1,alpha=inf")


@pytest.mark.parametrize("spelled, canonical", [
    ("exact", "exact"), ("", "exact"), ("lossy", LOSSY_PRESET), ("topk", "topk:k=3,delta=0.5"),
    ("topk:delta=0.25, k=5", "topk:k=5,delta=0.25"), ("typical", "typical:epsilon=0.09,alpha=0.3"),
    ("typical:alpha=inf,epsilon=1", "typical:epsilon=1,alpha=inf"),
])
def test_settings_are_held_in_one_spelling(spelled, canonical):
    assert str(parse_acceptance(spelled)) == canonical == SamplingParams(acceptance=spelled).acceptance
    assert SamplingParams(acceptance=spelled).lossy == (canonical != "exact")


@pytest.mark.parametrize("spelled, message", [
    ("fuzzy", "unknown acceptance 'fuzzy'"), ("topk:k=0", "k must be in [1, inf]"),
    ("topk:k=2.5", "k must be an integer"), ("topk:delta=2", "delta must be in [0, 1]"),
    ("topk:x=1", "topk takes k=..., delta=..."), ("topk:k", "topk takes"), ("topk:delta=nan", "delta must be in"),
    ("typical:epsilon=-0.1", "epsilon must be in [0, 1]"),
])
def test_bad_settings_name_the_problem(spelled, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(acceptance=spelled)


def test_the_relaxed_sets_by_hand():
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 4)
    tokens = torch.arange(4)
    assert parse_acceptance("topk:k=2,delta=0.5").admits(p, tokens).tolist() == [True, True, False, False]
    assert parse_acceptance("topk:k=4,delta=0.5").admits(p, tokens).tolist() == [True, True, False, False]
    assert parse_acceptance("topk:k=4,delta=0").admits(p, tokens).tolist() == [True] * 4
    assert not parse_acceptance("topk:k=4,delta=1").admits(p, tokens).any()  # nothing exceeds the top-1
    tied = torch.tensor([[0.4, 0.4, 0.2]] * 3)  # a tie counts against: k = 1 admits neither of two maxima
    assert not parse_acceptance("topk:k=1,delta=0").admits(tied, torch.arange(3)).any()
    entropy = float(-(p[0] * p[0].log()).sum())  # typical: the bar min(epsilon, alpha exp(-H))
    bar = min(0.25, 0.6 * torch.exp(torch.tensor(-entropy)).item())
    assert parse_acceptance("typical:epsilon=0.25,alpha=0.6").admits(p, tokens).tolist() == (p[0] > bar).tolist()
    assert not parse_acceptance("exact").admits(p, tokens).any()


def test_verifiers_keep_what_the_relaxed_set_admits():
    """Chains keep an admitted draft the exact test rejected (and emit the draft, not the target's
    token); a tree falls back to the admitted child the target finds most likely."""
    relaxation = Relaxation(admitted=[True, False, True], scores=[0.3, 0.1, 0.2])
    emitted = greedy_verify_tokens(torch.tensor([5, 6, 7]), torch.tensor([4, 6, 1, 2]), relaxation)
    assert emitted.tolist() == [5, 6, 7, 2] and relaxation.used == [0, 2]
    p = torch.tensor([[0.0, 1.0, 0.0]] * 3, dtype=torch.float64)  # the exact test rejects token 0 for sure
    chain = Relaxation(admitted=[True, False], scores=[0.0, 0.0])
    assert rejection_sample(torch.tensor([0, 2]), None, p, torch.Generator().manual_seed(0), relaxation=chain)[
        :1].tolist() == [0] and chain.used == [0]
    tree = Relaxation(admitted=[True, True, False], scores=[0.2, 0.5, 0.9])
    emitted, path = greedy_tree_verify_tokens(torch.tensor([3, 4, 5]), (-1, -1, -1), torch.tensor([9, 8, 8, 8]), tree)
    assert path.tolist() == [1] and emitted.tolist() == [4, 8] and tree.used == [1]


@pytest.fixture(scope="module")
def models(tiny_pair):
    # float64: a block scores each token as it would alone, so batched and single runs agree exactly
    return {name: load(tiny_pair[name], dtype="float64") for name in ("target", "perturbed", "independent")}


def cases(vocab: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(2, 10))] for _ in range(PROMPTS)]
    return [prompt * 2 if index % 2 else prompt for index, prompt in enumerate(prompts)]  # some repeat


def decoders(models) -> dict[str, SpeculativeDecoder]:
    target = models["target"]
    return {"perturbed chain": SpeculativeDecoder(target, make_drafter("model", models["perturbed"]), gamma=4),
            "independent chain": SpeculativeDecoder(target, make_drafter("model", models["independent"]), gamma=3),
            "perturbed tree": SpeculativeDecoder(target, make_drafter("tree", models["perturbed"]), gamma=3)}


def run(decoder: SpeculativeDecoder, prompts: list[list[int]], settings: SamplingParams, acceptance: str | None,
        batch: bool = False) -> list:
    """Each prompt with its own seed; ``acceptance`` None leaves the field at its default."""
    chosen = [dataclasses.replace(settings, seed=index, **({} if acceptance is None else {"acceptance": acceptance}))
              for index in range(len(prompts))]
    if batch:
        return decoder.generate(prompts, chosen)
    return [decoder.generate(prompt, setting) for prompt, setting in zip(prompts, chosen, strict=True)]


def same_runs(got: list, expected: list) -> None:
    for a, b in zip(got, expected, strict=True):
        assert a.token_ids == b.token_ids
        assert (a.stats.accepted, a.stats.drafted, a.stats.target_forwards) == \
            (b.stats.accepted, b.stats.drafted, b.stats.target_forwards)
        assert a.stats.relaxed_accepted == 0


@pytest.mark.parametrize("mode", [pytest.param(mode, marks=() if mode == FAST_MODE else pytest.mark.slow)
                                  for mode in MODES])
def test_exact_acceptance_is_the_default_bit_for_bit(models, mode):
    """acceptance="exact" gives the default's tokens and counts, alone and in a batch (whose greedy
    requests and sampled chains are verified in one pass); greedy equals the target alone's."""
    prompts = cases(models["target"].vocab_size)
    alone = run(SpeculativeDecoder(models["target"]), prompts, MODES["greedy"], None)
    for name, decoder in decoders(models).items():
        default = run(decoder, prompts, MODES[mode], None)
        same_runs(run(decoder, prompts, MODES[mode], "exact"), default)
        same_runs(run(decoder, prompts, MODES[mode], "exact", batch=True), default)
        assert all(result.stats.acceptance == "exact" for result in default)
        if mode == "greedy":
            assert [r.token_ids for r in default] == [r.token_ids for r in alone], name


@pytest.mark.parametrize("mode, acceptance", [
    pytest.param(mode, spec, marks=() if (mode, spec) == FAST_STRICTEST else pytest.mark.slow)
    for mode in MODES for spec in STRICTEST[mode]])
def test_each_scheme_at_its_strictest_equals_exact(models, mode, acceptance):
    """Tokens and acceptance counts equal exact's, alone and in a batch beside exact requests.
    (Mutations checked, each failing here: topk's rank "< k" made "<= k" fails greedy topk:k=1;
    its "p(x) > delta max p" made ">=" fails rejection's topk:k=50,delta=1; a chain keeping a draft
    on R alone instead of "exact test or R" fails rejection's typical:epsilon=1,alpha=inf; typical's
    bar lowered below epsilon fails both typical cases. Typical's ">" made ">=" passes: p(x) = 1
    exactly is a draft the exact test keeps anyway.)"""
    prompts = cases(models["target"].vocab_size)
    for decoder in decoders(models).values():
        exact = run(decoder, prompts, MODES[mode], "exact")
        same_runs(run(decoder, prompts, MODES[mode], acceptance), exact)
        # a batch of both: the exact requests go through the one-pass verifiers, the strict ones through the rule
        settings = [dataclasses.replace(MODES[mode], seed=index, acceptance=acceptance if index % 2 else "exact")
                    for index in range(len(prompts))]
        same_runs(decoder.generate(prompts, settings), exact)


@pytest.mark.parametrize("mode", MODES)
def test_a_relaxed_setting_keeps_more_and_marks_what_it_kept(models, mode):
    """Against the independent draft, the loose setting keeps drafts the exact test rejects, counted
    in relaxed_accepted and marked RELAXED in the stream, and the text differs from exact's.
    (Mutations checked: greedy's R reading the point mass p instead of softmax(logits) fails greedy;
    lossy requests joining the exact one-pass verifiers in a batch fails greedy and rejection.)"""
    prompts = cases(models["target"].vocab_size)
    decoder = decoders(models)["independent chain"]
    exact = run(decoder, prompts, MODES[mode], "exact")
    loose = run(decoder, prompts, MODES[mode], LOOSE)
    assert sum(r.stats.relaxed_accepted for r in loose) > 0
    assert sum(r.stats.accepted for r in loose) > sum(r.stats.accepted for r in exact)
    assert any(a.token_ids != b.token_ids for a, b in zip(loose, exact, strict=True))
    assert all(r.stats.acceptance == LOOSE and r.stats.to_dict()["lossy"] for r in loose)
    assert [r.token_ids for r in run(decoder, prompts, MODES[mode], LOOSE, batch=True)] == \
        [r.token_ids for r in loose]  # the rule reads the request alone: a batch changes nothing
    settings = dataclasses.replace(MODES[mode], seed=0, acceptance=LOOSE)
    chunks = list(decoder.stream(prompts[1], settings))
    marked = sum(source == TokenSource.RELAXED for chunk in chunks for source in chunk.sources)
    assert marked == chunks[-1].result.stats.relaxed_accepted
