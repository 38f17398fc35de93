"""The auto drafter: lossless with every candidate set (greedy identity, the sampled law, the
coupled rule), and its choice follows what each candidate is measured to give."""

import pytest
import torch
from test_greedy_equality import DRAFT_KINDS, check_equality, random_cases
from test_heads import perturbed, trained_head

from specdec import SamplingParams, SpeculativeDecoder, load, make_drafter
from specdec.core.drafts import BaseDrafter, ContextRequest, Draft, StepOutcome
from specdec.core.estimates import MIN_PROBE_PERIOD, CostModel
from specdec.drafting.auto import AutoDrafter, judged
from specdec.drafting.ngram import NGramDrafter


@pytest.fixture(scope="module")
def models(tiny_pair):
    target = load(tiny_pair["target"], dtype="float64")
    return target, {kind: load(tiny_pair[kind], dtype="float64") for kind in DRAFT_KINDS}


def test_a_guess_not_verified_is_judged_by_the_tokens_emitted():
    assert judged([5, 6, 7], [5, 9]) == (3, 1)  # rejected at its second token
    assert judged([5, 6, 7], [8]) == (3, 0)
    assert judged([5, 6], [5, 6, 2]) == (2, 2)  # all of it agreed
    assert judged([5, 6, 7, 8], [5, 6]) == (2, 2)  # agreed as far as was seen: no more is known
    assert judged([], [1]) is None and judged(None, [1]) is None


@pytest.mark.slow
def test_auto_with_text_candidates_equals_target_only(models):
    """One drafter over all the cases, so the suffix cache is warm from earlier outputs."""
    target, _ = models
    check_equality(target, {"auto": make_drafter("auto", target=target)}, "auto")


@pytest.mark.slow
def test_auto_with_a_draft_model_equals_target_only(models):
    target, drafts = models
    drafters = {kind: make_drafter("auto", drafts[kind], target=target) for kind in DRAFT_KINDS}
    counts = check_equality(target, drafters, "auto")
    # (how often the model is chosen depends on measured time: a draft as big as the target rarely pays)
    assert all(drafted > 0 for _, drafted in counts.values()), counts


@pytest.mark.slow
def test_auto_with_a_head_equals_target_only(models, tmp_path_factory):
    target, drafts = models
    head = trained_head(target, tmp_path_factory.mktemp("head"))
    drafters = {"head": make_drafter("auto", target=target, head=head),
                "head+model": make_drafter("auto", drafts["perturbed"], target=target, head=perturbed(head, 0.5, 2))}
    check_equality(target, drafters, "auto")
    names = ["suffix", "ngram", "ngram-edit", "prediction", "head", "model"]
    assert [c.name for c in drafters["head+model"].candidates] == names


def test_auto_drafts_with_the_candidate_that_pays(models):
    """On a clock where every reading takes 1 ms (a draft costs about what a verify block of any
    length costs, so only acceptance decides), a draft model that is the target wins most steps; an
    independent one is dropped for the text drafters or none once measured (its acceptance is near
    zero). (Timed for real, a tiny draft as big as the target costs a target forward a token: then
    no draft of it pays, rightly.)"""
    from law import StepClock

    target, drafts = models
    prompts = [prompt for prompt, _, _ in random_cases(3, target.vocab_size, 12)]
    used = {}
    for kind in ("same", "independent"):
        drafter = make_drafter("auto", drafts[kind], target=target, costs=CostModel(clock=StepClock()))
        decoder = SpeculativeDecoder(target, drafter, gamma=6, policy="auto")
        steps: dict[str, int] = {}
        for prompt in prompts:
            for name, (count, _, _) in decoder.generate(prompt, max_new_tokens=32).stats.by_drafter.items():
                steps[name] = steps.get(name, 0) + count
        used[kind] = steps
    share = {kind: steps.get("model", 0) / sum(steps.values()) for kind, steps in used.items()}
    # a cheap candidate's probes come in pairs every MIN_PROBE_PERIOD idle steps: 2 of 9 steps once
    # its estimate has fallen (more before)
    assert share["same"] > 0.6 and share["independent"] < 2 / (MIN_PROBE_PERIOD + 1) + 0.2, used


def test_the_cost_model_weighs_acceptance_against_cost():
    """The choice itself: a text draft accepted often beats a costly forward candidate; the same
    candidate, cheap and accepted, beats it; where nothing is accepted, no draft."""
    from specdec.drafting.auto import AutoState

    auto = AutoDrafter({"ngram": NGramDrafter(3), "head": NGramDrafter(3)}, ("ngram",))
    auto.costs.verify.add(1, 1, 0.010)
    auto.costs.verify.add(1, 5, 0.012)

    def state(text_alpha: float, head_alpha: float, shadow: list[int]) -> AutoState:
        s = auto.start(torch.tensor([1, 2, 3]))
        s.shadows = [shadow, None]
        for index, alpha in enumerate((text_alpha, head_alpha)):
            for _ in range(200):
                s.estimates(index).update(1, 1 if torch.rand(()) < alpha else 0)
        return s

    torch.manual_seed(0)
    auto.costs.draft("head").add(0.004, 1)
    assert auto.choose(state(0.9, 0.9, [5, 6, 7, 8]), 8).candidate == 0  # free and accepted
    assert auto.choose(state(0.05, 0.95, [5]), 8).candidate == 1  # the head is worth its cost
    assert auto.choose(state(0.0, 0.0, [5, 6]), 8).candidate is None  # nothing pays
    auto.costs.drafts.clear()
    auto.costs.draft("head").add(0.050, 1)  # five target forwards a token: never worth it
    assert auto.choose(state(0.05, 0.95, [5]), 8).candidate != 1


def test_the_steps_each_candidate_drafted_are_counted(models):
    target, _ = models
    prompt = [3, 4, 5, 6, 7] * 6
    result = SpeculativeDecoder(target, make_drafter("auto", target=target), policy="auto").generate(
        prompt, max_new_tokens=24)
    steps = result.stats.by_drafter
    assert sum(count for count, _, _ in steps.values()) == result.stats.target_forwards
    assert sum(drafted for _, drafted, _ in steps.values()) == result.stats.drafted
    assert sum(accepted for _, _, accepted in steps.values()) == result.stats.accepted
    assert set(steps) <= {"suffix", "ngram", "ngram-edit", "none"}
    assert result.stats.to_dict()["by_drafter"] == steps
    assert "steps" in result.stats.drafter_summary()


def test_a_step_with_no_room_to_draft_counts_as_none(models):
    """The last token of a budget leaves no room for a draft: auto is not asked, and the step
    counts as no draft (every step under one name; timing once decided whether a run had one)."""
    target, _ = models
    result = SpeculativeDecoder(target, make_drafter("auto", target=target), policy="auto").generate(
        [3, 4, 5, 6, 7] * 6, max_new_tokens=1)
    assert result.stats.target_forwards == 1
    assert result.stats.by_drafter == {"none": [1, 0, 0]}


def test_auto_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="at least one"):
        AutoDrafter({}, ())
    with pytest.raises(ValueError, match="choice of no draft"):
        AutoDrafter({"none": NGramDrafter(3)}, ("none",))


def test_a_forward_candidate_is_probed_after_idle_steps():
    """A candidate that is never best still drafts, two steps in a row, once it has sat idle for
    its probe period (its estimate stays alive: estimates.ProbeRule); the period is the cost
    model's longest for a costly candidate, MIN_PROBE_PERIOD for a cheap one (mutation: one-step
    probes fail the pairs; a fixed period fails the cheap candidate's)."""
    from specdec.core.drafts import StepOutcome

    def probed_steps(seconds_per_token: float, longest: int, steps: int) -> list[int]:
        auto = AutoDrafter({"ngram": NGramDrafter(3), "slow": NGramDrafter(3)}, ("ngram",),
                           costs=CostModel(max_probe_period=longest))
        auto.costs.draft("slow").add(seconds_per_token, 1)
        auto.costs.verify.add(1, 1, 0.01)
        auto.costs.verify.add(1, 2, 0.01)
        auto.costs.verify.add(1, 3, 0.012)
        request = ContextRequest.started(auto, torch.tensor([1, 2, 3, 1, 2]))
        probed = []
        for step in range(1, steps + 1):
            draft = auto.propose(request, 4)
            assert draft.drafter in ("ngram", "none", "slow")
            if draft.drafter == "slow":
                probed.append(step)
            auto.observe(request, StepOutcome(torch.tensor([1]), 0, verify_seconds=0.01))
        return probed

    assert probed_steps(10.0, 4, 12) == [4, 5, 9, 10]  # the 4th idle step in a row, and the one after it
    assert probed_steps(10.0, 64, 80) == [64, 65]
    costs = CostModel(max_probe_period=64)
    costs.verify.add(1, 1, 0.010)
    costs.verify.add(1, 2, 0.011)
    for seconds_per_token, period in ((1e-6, MIN_PROBE_PERIOD), (0.0015, 17), (0.050, 64)):
        # two one-token drafts, each its cost and T(2) - T(1), are 3% of the T(1) steps between probes
        assert costs.probe_period(seconds_per_token, steps=2) == period
    assert costs.probe_period(None) == 64  # a cost not measured yet: the longest


def test_a_forward_candidates_cost_is_read_from_steady_steps():
    """A forward candidate's drafts after idle steps (which first feed it their tokens) count only
    until a draft right after one of its own is measured: that one's cost is what auto weighs
    (mutation: recording every step in the steady estimate keeps the cold steps' cost)."""
    from specdec.core.drafts import StepOutcome

    class Clock:  # the cost model's clock, moved on by the drafter's "work"
        now = 0.0

        def __call__(self) -> float:
            return self.now

    clock = Clock()

    class Slow(NGramDrafter):
        def propose(self, request, gamma):
            clock.now += self.seconds
            return super().propose(request, gamma)

    slow = Slow(3)
    auto = AutoDrafter({"ngram": NGramDrafter(3), "head": slow}, ("ngram",), costs=CostModel(clock=clock))
    auto.costs.verify.add(1, 1, 0.01)
    request = ContextRequest.started(auto, torch.tensor([1, 2, 3, 1, 2]))
    for seconds in (0.05, 0.001):  # untried: drafted (cold: a backlog), then its follow-up (steady)
        slow.seconds = seconds
        draft = auto.propose(request, 4)
        assert draft.drafter == "head"
        auto.observe(request, StepOutcome(torch.tensor([1]), draft.num_nodes, verify_seconds=0.01))
    assert auto.candidates[1].cold_cost.seconds() > 0.01
    assert auto.draft_seconds(1) < 0.01


@pytest.mark.slow
def test_auto_law_of_three_tokens(tmp_path_factory):
    """Chi-square of 20k seeded 3-token generations against the enumerated law of a 6-token target,
    auto with a head, the text drafters and a perturbed draft model as candidates, temperature 0.9."""
    from law import assert_matches_law, sample_sequences
    from test_heads import exact_law
    from tiny import save_random_model

    from specdec.drafting.head_format import new_head

    folder = save_random_model(tmp_path_factory.mktemp("six"), vocab_size=6, seed=5, init_scale=0.5,
                               tokenizer=False, bos_token_id=None, eos_token_id=None)
    draft_folder = save_random_model(tmp_path_factory.mktemp("six-draft"), vocab_size=6, seed=6, init_scale=0.5,
                                     tokenizer=False, bos_token_id=None, eos_token_id=None)
    target, draft = load(folder, dtype="float64"), load(draft_folder, dtype="float64")
    torch.manual_seed(4)
    head = new_head(target, torch.tensor([0, 2, 3, 5])).to(target.dtype)
    with torch.no_grad():
        head.lm_head.weight.mul_(20.0)
    sampling = SamplingParams(temperature=0.9)
    prompt = [1, 4, 2, 1, 4]
    decoder = SpeculativeDecoder(target, make_drafter("auto", draft, target=target, head=head), gamma=3,
                                 policy="auto")
    counts, accepted, drafted = sample_sequences(decoder, prompt, sampling, 3, 20000)  # (on its step clock)
    assert 0 < accepted < drafted
    assert_matches_law(counts, exact_law(target, prompt, 3, sampling), "auto")


def test_auto_under_the_coupled_rule_gives_the_target_alone_text(models):
    """With a seed (the coupled rule), auto's sampled text is the target alone's, whatever it drafts."""
    target, drafts = models
    decoder = SpeculativeDecoder(target, make_drafter("auto", drafts["perturbed"], target=target), policy="auto")
    alone = SpeculativeDecoder(target)
    for seed, (prompt, length, _) in enumerate(random_cases(11, target.vocab_size, 20)):
        sampling = SamplingParams(temperature=0.8, seed=seed, max_new_tokens=length)
        assert decoder.generate(prompt, sampling).token_ids == alone.generate(prompt, sampling).token_ids


def test_one_argument_in_python(models):
    """SpeculativeDecoder(target, "auto"): the auto drafter with its own policy, capped at 16 tokens."""
    target, _ = models
    decoder = SpeculativeDecoder(target, "auto")
    assert isinstance(decoder.drafter, AutoDrafter)
    policy = decoder.engine.new_policy()
    assert policy.name == "auto" and policy.next_shape().depth == 16
    prompt = [5, 6, 7, 8, 9] * 5
    assert decoder.generate(prompt, max_new_tokens=30).token_ids == \
        SpeculativeDecoder(target).generate(prompt, max_new_tokens=30).token_ids
    assert SpeculativeDecoder(target, "ngram").engine.new_policy().next_shape().depth == 4  # fixed, gamma 4


class FixedGuess(BaseDrafter):
    """A text drafter that always guesses the same chain."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def start(self, prompt_ids: torch.Tensor) -> None:
        return None

    def propose(self, request, gamma: int) -> Draft:
        return Draft(torch.tensor(self.tokens[:gamma], dtype=torch.long))

    def observe(self, request, outcome: StepOutcome) -> None:
        pass


class RefusesNine:
    """A grammar look-ahead that refuses token 9 wherever it comes."""

    @staticmethod
    def valid_prefix(tokens: list[int]) -> int:
        return tokens.index(9) if 9 in tokens else len(tokens)


def test_a_constrained_request_chooses_among_what_its_grammar_lets_through():
    """The better-rated copy starts with a token the grammar refuses: the engine would cut it to
    nothing, so auto verifies the other copy's valid draft instead, and learns nothing of the
    refused guess (mutation checked: without the cut, candidate "refused" is chosen, its draft
    [9, 1, 2], and the step's outcome counts as its rejection)."""
    auto = AutoDrafter({"refused": FixedGuess([9, 1, 2]), "valid": FixedGuess([4, 5])}, ("refused", "valid"))
    auto.costs.verify.add(1, 1, 0.010)
    auto.costs.verify.add(1, 5, 0.011)
    request = ContextRequest.started(auto, torch.tensor([1, 2, 3]), matcher=RefusesNine())
    for index, alpha in enumerate((0.95, 0.7)):
        for _ in range(50):
            request.draft_state.estimates(index).update(3, 3 if alpha > 0.9 else 2)
    draft = auto.propose(request, 3)
    assert (draft.drafter, draft.tokens.tolist()) == ("valid", [4, 5])
    before = [estimates.alphas() for estimates in request.draft_state.acceptance[0]]
    auto.observe(request, StepOutcome(torch.tensor([4, 5, 6]), num_drafted=2))
    assert [estimates.alphas() for estimates in request.draft_state.acceptance[0]] == before


def test_copies_are_judged_apart_by_how_far_the_shortest_reaches():
    """A step where one copy's match ran out (its draft is short) is another class than one where
    every copy reaches far: a long copy accepted in the second says nothing of the first (mutation
    checked: with one class for all steps, the long ngram draft is chosen at the short-reach step)."""
    auto = AutoDrafter({"suffix": FixedGuess([4, 5]), "ngram": FixedGuess(list(range(10, 22)))}, ("suffix", "ngram"))
    auto.costs.verify.add(1, 1, 0.010)
    auto.costs.verify.add(1, 13, 0.011)
    request = ContextRequest.started(auto, torch.tensor([1, 2, 3]))
    # classes are (the step's reach class) * 3 + (the copy's own); ngram's own is 8+ tokens in both
    far, near = request.draft_state.acceptance[1][2 * 3 + 2], request.draft_state.acceptance[1][0 * 3 + 2]
    for _ in range(50):
        far.update(12, 12)  # every copy reached 8+ tokens: ngram's long guesses were right
        near.update(12, 0)  # the shortest copy reached under 4: ngram's first token was wrong
    draft = auto.propose(request, 12)
    assert request.draft_state.reach_class == 0 and draft.drafter != "ngram", draft


def test_a_chosen_copy_learns_of_its_guess_past_the_verified_length():
    """A copy verified 8 tokens at a time, all accepted, whose 9th guess was right too (the step's
    last token): auto learns the 9th position from it and drafts longer (mutation checked: judging
    the chosen copy only on its verified tokens keeps every draft at 8, as the pooled estimate
    from other requests says the 9th fails)."""
    guess = list(range(10, 26))
    auto = AutoDrafter({"copy": FixedGuess(guess)}, ("copy",))
    auto.costs.verify.add(1, 1, 0.010)
    auto.costs.verify.add(1, 17, 0.058)
    request = ContextRequest.started(auto, torch.tensor([1, 2, 3]))
    own = sum(16 >= bound for bound in (4, 8))  # the copy's own reach class (16 tokens: 8+)
    for _ in range(50):
        auto.candidates[0].pooled[2 * 3 + own].update(16, 8)  # elsewhere, the 9th was refused
        request.draft_state.acceptance[0][2 * 3 + own].update(8, 8)
    lengths = []
    for _ in range(40):
        draft = auto.propose(request, 16).tokens.tolist()
        lengths.append(len(draft))
        auto.observe(request, StepOutcome(torch.tensor(guess[: len(draft) + 1]), num_drafted=len(draft)))
    assert lengths[0] == 8 and lengths[-1] == 16, lengths
