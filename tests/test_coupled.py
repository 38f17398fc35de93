"""The coupled sampling rule (specdec.core.rules.CoupledRule, Daliri, Musco and Suresh 2024): each draw
has exactly p's law, seeded output equals the target alone's seeded output whatever drafts it
(any drafter, gamma, tree, batch), and a seed gives one text under every policy even when the
measured timings, and so the draft lengths, differ between runs."""

import itertools
import random
from collections import Counter

import numpy as np
import pytest
import torch
from law import StepClock, assert_matches_law, sample_sequences
from scipy.stats import chisquare
from table_lm import table_model
from test_distribution import PROMPT, exact_sequence_law

from specdec import SamplingParams, SpeculativeDecoder, load, make_drafter
from specdec.assembly import engine_of
from specdec.core.estimates import CostModel
from specdec.core.rules import CoupledRule, position_exponentials

SEEDS = 20000


def random_probs(seed: int, vocab: int) -> torch.Tensor:  # [vocab] float64
    generator = torch.Generator().manual_seed(seed)
    return (2.0 * torch.randn(vocab, generator=generator, dtype=torch.float64)).softmax(-1)


@pytest.mark.slow
def test_a_coupled_draw_has_the_law_of_p():
    """Over seeds at one position, and over positions for one seed (each position's noise is
    fresh): chi-square against p, with a zero-probability token never drawn."""
    p = random_probs(0, 6)
    p[4] = 0.0
    p /= p.sum()
    over_seeds = Counter(int(CoupledRule(seed).draw(p[None], [7])[0]) for seed in range(SEEDS))
    rule = CoupledRule(3)
    over_positions = Counter(int(rule.draw(p[None], [position])[0]) for position in range(SEEDS))
    for counts in (over_seeds, over_positions):
        assert counts[4] == 0
        observed = [counts[token] for token in range(6) if token != 4]
        expected = [SEEDS * float(p[token]) for token in range(6) if token != 4]
        assert chisquare(observed, expected).pvalue > 1e-3


def test_noise_depends_on_seed_and_position_only():
    first = position_exponentials(5, 40, 16)
    assert torch.equal(first, position_exponentials(5, 40, 16))
    assert not torch.equal(first, position_exponentials(5, 41, 16))
    assert not torch.equal(first, position_exponentials(6, 40, 16))
    assert bool((first > 0).all())


def test_distinct_draws_are_draws_without_replacement_led_by_the_coupled_draw():
    """Gumbel-top-k: the first of draw_distinct is draw's token, and the ordered pair has the
    law of two draws without replacement, p(a) p(b) / (1 - p(a))."""
    p = random_probs(1, 5)
    pairs = Counter()
    for seed in range(SEEDS):
        rule = CoupledRule(seed)
        first, second = rule.draw_distinct(p, 3, 2).tolist()
        assert first == int(rule.draw(p[None], [3])[0])
        pairs[(first, second)] += 1
    law = {(a, b): float(p[a] * p[b] / (1 - p[a])) for a, b in itertools.permutations(range(5), 2)}
    assert_matches_law(pairs, law, "pairs")


@pytest.mark.slow
def test_a_draft_matches_the_target_at_least_as_often_as_the_bound_says():
    """P(draw under q == draw under p) >= (1 - TV) / (1 + TV) (Daliri et al., Theorem 2)."""
    p, q = random_probs(2, 8), random_probs(3, 8)
    total_variation = 0.5 * float((p - q).abs().sum())
    bound = (1 - total_variation) / (1 + total_variation)
    same = sum(int(CoupledRule(seed).draw(torch.stack([p, q]), [0, 0]).unique().numel() == 1) for seed in range(SEEDS))
    assert same / SEEDS > bound - 4 * (bound * (1 - bound) / SEEDS) ** 0.5, (same / SEEDS, bound)
    assert same / SEEDS < 1 - total_variation + 0.02  # and it cannot beat rejection sampling's 1 - TV


@pytest.mark.slow
@pytest.mark.parametrize("kind, sampling", [
    ("tree", SamplingParams(temperature=0.8, top_k=5, sampling_rule="coupled")),
    ("staged-tree", SamplingParams(temperature=1.0, top_k=3, sampling_rule="coupled")),
    ("model", SamplingParams(temperature=1.2, top_p=0.8, sampling_rule="coupled")),
], ids=["tree", "staged-tree", "chain"])
def test_end_to_end_law_of_three_tokens(kind, sampling):
    """10k seeded 3-token generations in batches of 100 against the enumerated target law, with
    trees, temperature, top-k and top-p on both sides."""
    vocab, length = 6, 3
    target, draft = table_model(vocab, seed=100), table_model(vocab, seed=101, sharpness=1.0)
    drafter = make_drafter(kind, draft, max_n=2, tree_budget=6)
    decoder = SpeculativeDecoder(target, drafter, gamma=3)
    counts, accepted, drafted = sample_sequences(decoder, PROMPT, sampling, length, 10000)
    assert 0 < accepted < drafted
    assert_matches_law(counts, exact_sequence_law(target, PROMPT, length, sampling), kind)


@pytest.fixture(scope="module")
def float64_pair(tiny_pair):
    target = load(tiny_pair["target"], dtype="float64")
    return target, load(tiny_pair["perturbed"], dtype="float64")


def invariance_drafters(target, draft) -> dict:
    from test_heads import identity_head, perturbed

    head = perturbed(identity_head(target), 0.3, seed=4)
    return {
        "model": make_drafter("model", draft), "ngram": make_drafter("ngram", max_n=3),
        "staged": make_drafter("staged", draft, max_n=3), "tree": make_drafter("tree", draft, tree_budget=10),
        "ngram-tree": make_drafter("ngram-tree", max_n=3, tree_budget=8),
        "staged-tree": make_drafter("staged-tree", draft, max_n=3, tree_budget=10),
        "tree+ngram-tree": make_drafter("tree+ngram-tree", draft, max_n=3, tree_budget=10),
        "head": make_drafter("head", head=head, target=target),
        "head-tree": make_drafter("head-tree", head=head, target=target, tree_budget=10),
    }


SAMPLINGS = [dict(temperature=1.0), dict(temperature=0.8, top_k=5), dict(temperature=1.2, top_p=0.9),
             dict(temperature=0.7, min_p=0.1)]


def invariance_cases(vocab: int, count: int = 240):
    """(prompt, sampling, gamma): random prompts, half repetitive, every sampling kind, gamma 1-8."""
    rng = random.Random(11)
    for index in range(count):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
        if index % 2:
            prompt = prompt * 2
        sampling = SamplingParams(**SAMPLINGS[index % len(SAMPLINGS)], seed=1000 + index,
                                  max_new_tokens=rng.randint(4, 24), sampling_rule="coupled")
        yield prompt, sampling, 1 + index % 8


@pytest.mark.slow
def test_coupled_output_is_the_target_alone_whatever_drafts_it(float64_pair):
    """240 prompts: each speculative run, alone and in a batch of 8 (mixed samplings and seeds),
    equals the target alone with the same seed, token for token, for every drafter (rotating) and
    gamma 1-8. Mutation, checked: keying the noise on the request's step count instead of the
    output position fails it (a step emits several tokens: its positions differ)."""
    target, draft = float64_pair
    drafters = invariance_drafters(target, draft)
    alone_target = SpeculativeDecoder(target)
    cases = list(invariance_cases(target.vocab_size))
    expected = [alone_target.generate(prompt, sampling).token_ids for prompt, sampling, _ in cases]
    accepted = Counter()
    names = list(drafters)
    for index, ((prompt, sampling, gamma), reference) in enumerate(zip(cases, expected, strict=True)):
        name = names[index % len(names)]
        result = SpeculativeDecoder(target, drafters[name], gamma=gamma).generate(prompt, sampling)
        assert result.token_ids == reference, (name, gamma, prompt, sampling)
        accepted[name] += result.stats.accepted
    for start in range(0, len(cases), 8):
        batch = cases[start : start + 8]
        name, gamma = names[(start // 8) % len(names)], batch[0][2]
        results = SpeculativeDecoder(target, drafters[name], gamma=gamma).generate(
            [prompt for prompt, _, _ in batch], [sampling for _, sampling, _ in batch])
        assert [r.token_ids for r in results] == expected[start : start + 8], (name, gamma)
    # Coupled drafting really agrees with the target (the drafters draw with the same noise).
    assert all(accepted[name] > 0 for name in names), accepted


class SlowClock:
    """A cost model's clock as a loaded machine shows it: every reading advances by a growing,
    irregular amount, so measured draft and verify seconds differ from an idle run's."""

    def __init__(self) -> None:
        self.now, self.calls = 0.0, 0

    def __call__(self) -> float:
        self.calls += 1
        self.now += 0.001 * (1 + (self.calls * 7919) % 13) ** 2
        return self.now


@pytest.mark.parametrize("drafter_kind, policy", [("model", "cost"), ("tree", "tree-cost"), ("staged", "heuristic")])
def test_a_seed_gives_one_text_under_every_policy_whatever_the_timings(float64_pair, drafter_kind,
                                                                        policy):
    """Two runs per prompt with one seed (the default rule for a seeded request), the first with a
    regular clock, the second with a slow, irregular one: the draft lengths differ, the texts do
    not. (The first run read the machine's clock once: on some runs its timings led the cost policy
    to the slow clock's draft lengths, and the check that they differ failed.)"""
    target, draft = float64_pair
    drafter = make_drafter(drafter_kind, draft, tree_budget=10)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8], [1, 4, 1, 4, 2, 1, 3, 5]]
    samplings = [SamplingParams(temperature=0.9, top_k=8, seed=seed, max_new_tokens=40) for seed in range(3)]
    assert samplings[0].rule == "coupled"
    # (probes at most 8 steps apart, so that a cost policy that stops drafting keeps measuring)
    decoder = SpeculativeDecoder(target, drafter, gamma=4, policy=policy,
                                 costs=CostModel(max_probe_period=8, clock=StepClock()))
    idle = [decoder.generate(prompt, sampling) for prompt, sampling in zip(prompts, samplings, strict=True)]
    decoder = SpeculativeDecoder(target, drafter, gamma=4, policy=policy,
                                 costs=CostModel(max_probe_period=8, clock=SlowClock()))
    loaded = [decoder.generate(prompt, sampling) for prompt, sampling in zip(prompts, samplings, strict=True)]
    assert [r.token_ids for r in loaded] == [r.token_ids for r in idle]
    if policy != "heuristic":  # the cost policies read the clock: their drafts really changed
        assert [r.stats.drafted for r in loaded] != [r.stats.drafted for r in idle]


def test_a_seed_gives_one_text_under_the_servers_controller(float64_pair):
    """The scheduler's speculation controller picks draft lengths from a cost table of the
    machine: two tables (an idle and a loaded machine) give different draft lengths, one text."""
    import threading

    from specdec.core.estimates import VerifyCostTable
    from specdec.serving.scheduler import Scheduler
    from specdec.serving.speculation import SpeculationController

    target, draft = float64_pair
    drafter = make_drafter("model", draft)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8], [1, 4, 1, 4, 2, 1], [5, 5, 3]]
    samplings = [SamplingParams(temperature=1.0, seed=seed, max_new_tokens=30) for seed in range(len(prompts))]

    def serve(slope: float, draft_cost: float) -> tuple[list, list]:
        costs = VerifyCostTable()
        for batch, block in itertools.product((1, 2, 4), (1, 2, 3, 5)):
            costs.add(batch, block, 0.1 + slope * batch * block)
        engine = engine_of(target, drafter, gamma=4)
        engine.costs.verify.include(costs)
        controller = SpeculationController("auto", gamma=4, costs=engine.costs, draft_cost=draft_cost)
        scheduler = Scheduler(engine, controller, max_batch=4).start()
        results, done = {}, threading.Event()

        def emitter(index):
            def emit(item):
                if item.result is not None:
                    results[index] = (item.result.token_ids, item.result.stats.drafted)
                    if len(results) == len(prompts):
                        done.set()
            return emit

        try:
            for index, (prompt, sampling) in enumerate(zip(prompts, samplings, strict=True)):
                scheduler.submit(prompt, sampling, emitter(index))
            assert done.wait(120)
        finally:
            scheduler.stop()
        return [results[i][0] for i in range(len(prompts))], [results[i][1] for i in range(len(prompts))]

    idle_text, idle_drafted = serve(slope=0.001, draft_cost=0.001)
    loaded_text, loaded_drafted = serve(slope=0.05, draft_cost=0.02)
    assert loaded_text == idle_text
    assert loaded_drafted != idle_drafted
    alone = [SpeculativeDecoder(target).generate(p, s).token_ids for p, s in zip(prompts, samplings, strict=True)]
    assert idle_text == alone
    assert np.mean(idle_drafted) > 0
