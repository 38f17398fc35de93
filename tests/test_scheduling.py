"""Continuous batching and the speculation controller, without HTTP: requests that join a running
batch get what they get alone; the draft length follows the measured costs of the batch size."""

import threading
import time

import pytest
from test_batching import batch_prompts

from specdec import SamplingParams, SpeculativeDecoder, load, make_drafter
from specdec.assembly import engine_of
from specdec.core.estimates import AcceptanceByPosition, CostModel, VerifyCostTable
from specdec.serving.scheduler import PrefillBudget, QueueFullError, Scheduler
from specdec.serving.speculation import SpeculationController, profile_verify_costs


def bandwidth_bound_table(batches=(1, 2, 4, 8, 16, 32), blocks=(1, 2, 3, 5)) -> VerifyCostTable:
    """T = max(reading the weights, computing every token): flat while few tokens, then linear."""
    table = VerifyCostTable()
    for batch in batches:
        for block in blocks:
            table.add(batch, block, max(0.1, 0.01 * batch * block))
    return table


def bandwidth_bound_costs(max_probe_period: int = 64) -> CostModel:
    return CostModel(max_probe_period=max_probe_period, verify=bandwidth_bound_table())


def learned_acceptance(alpha: float, steps: int = 200) -> AcceptanceByPosition:
    acceptance = AcceptanceByPosition(max_gamma=4)
    for step in range(steps):  # every position accepted with probability ~alpha, deterministically
        accepted = next((i for i in range(4) if (step * 7 + i * 3) % 10 >= alpha * 10), 4)
        acceptance.update(4, accepted)
    return acceptance


def test_cost_table_reads_recent_cells_fits_the_rest_and_never_decreases():
    """Mutation: reading every cell as measured, however faded, makes T(4, 3) 0.12."""
    table = bandwidth_bound_table()
    assert table.estimate(4, 5) == pytest.approx(0.2)  # the cell measured last at batch 4
    assert table.estimate(4, 3) == pytest.approx(0.137, abs=0.001)  # faded below one step's weight: the line
    assert table.estimate(4, 4) == pytest.approx(0.163, abs=0.001)  # not measured: the line
    assert table.estimate(12, 5) == pytest.approx(0.6)  # between batches 8 and 16
    assert table.estimate(64, 5) >= table.estimate(32, 5)  # beyond the grid: the last slope
    assert VerifyCostTable().estimate(1, 1) is None
    table.add(4, 5, 1.2)  # online measurements move the cell (decayed mean)
    assert 0.2 < table.estimate(4, 5) < 1.2


class Client:
    """A request, as the controller sees one: something to keep its acceptance estimates by."""


def lengths_for(controller: SpeculationController, batch: int) -> list[int]:
    return controller.draft_lengths([Client() for _ in range(batch)])


def test_auto_drafts_when_the_batch_is_small_and_stops_when_it_fills():
    controller = SpeculationController("auto", gamma=4, costs=bandwidth_bound_costs(),
                                       acceptance=learned_acceptance(0.8), draft_cost=0.002)
    choices = {batch: sum(lengths_for(controller, batch)) / batch for batch in (1, 2, 4, 8, 16, 32)}
    assert choices[1] == 4 and choices[32] == 0
    assert all(choices[a] >= choices[b] for a, b in zip((1, 2, 4, 8, 16), (2, 4, 8, 16, 32), strict=True))
    assert lengths_for(controller, 1) == [4]  # and it returns when the batch empties
    # a slow drafter that is rarely right never pays
    poor = SpeculationController("auto", gamma=4, costs=bandwidth_bound_costs(), acceptance=learned_acceptance(0.1),
                                 draft_cost=0.05)
    assert lengths_for(poor, 1) == [0]


def test_the_policy_and_the_controller_choose_with_one_cost_model():
    """At one request, the cost policy and the server's controller, given the same acceptance
    and one CostModel, ask for the same draft length: one model, two clients."""
    from specdec.core.policy import CostModelPolicy

    acceptance = learned_acceptance(0.8)
    choices = []
    for draft_seconds in (0.001, 0.005, 0.02, 0.05, 0.2):
        costs = CostModel()
        for block in (1, 2, 3, 5, 9):
            costs.verify.add(1, block, 0.1 * (1 + 0.05 * block))
        controller = SpeculationController("auto", gamma=4, costs=costs, acceptance=acceptance,
                                           draft_cost=draft_seconds)
        policy = CostModelPolicy(max_gamma=4, acceptance=acceptance, costs=costs)
        [choice] = lengths_for(controller, 1)
        choices.append(choice)
        assert policy.next_shape().depth == choice, draft_seconds
    assert choices[0] == 4 and choices[-1] == 0 and len(set(choices)) >= 3  # the cost decides


def test_a_request_the_drafter_guesses_well_drafts_longer_than_its_neighbour():
    """Each request's own acceptance decides its share of the batch's draft tokens: after the
    same steps, one whose drafts were all accepted drafts gamma, one whose drafts never were
    drafts nothing, in one batch. Mutation, checked: pooled acceptance only (every request
    alike) gives both the same length."""
    costs = bandwidth_bound_costs()
    controller = SpeculationController("auto", gamma=4, costs=costs, draft_cost=0.002)
    good, poor = Client(), Client()
    for _ in range(40):
        controller.observe([good, poor], 0.016, [(4, 4), (4, 0)])
    good_length, poor_length = controller.draft_lengths([good, poor])
    assert good_length == 4 and poor_length == 0
    newcomer = Client()  # starts from the pooled estimates: between the two
    assert 0 <= controller.draft_lengths([newcomer, good])[0] <= 4


def test_where_drafting_does_not_pay_a_one_token_probe_keeps_acceptance_measured():
    controller = SpeculationController("auto", gamma=4, costs=bandwidth_bound_costs(max_probe_period=5),
                                       acceptance=learned_acceptance(0.1), draft_cost=0.05)
    batch = [Client(), Client(), Client()]
    choices = [controller.draft_lengths(batch) for _ in range(10)]
    assert [sum(lengths) for lengths in choices] == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1]


def test_the_servers_choice_replaces_each_requests_policy(tiny_pair):
    """Engine.step's draft_lengths are each request's draft length, not a cap on its policy's:
    a fixed gamma-2 policy drafts 4 when the server says 4, and nothing when it says 0."""
    target = load(tiny_pair["target"], dtype="float64")
    engine = engine_of(target, make_drafter("model", load(tiny_pair["perturbed"], dtype="float64")), gamma=2)
    requests = [engine.new_request(prompt, SamplingParams(max_new_tokens=20), row=row)
                for row, prompt in enumerate(batch_prompts(3, target.vocab_size, count=2))]
    cache = target.new_cache(rows=2)
    engine.prefill(requests, cache)
    outcomes = engine.step(requests, cache, [4, 0])
    assert [outcome.num_drafted for outcome in outcomes] == [4, 0]


def test_an_engine_whose_caller_chooses_lengths_builds_no_policy(tiny_pair):
    """A server's engine (requests_choose_lengths=False) gives requests no policy: a threshold
    policy's stop_early cannot cut the controller's drafts, and a step without draft_lengths is an
    error. Mutation: requests_choose_lengths ignored in build_engine fails it."""
    target = load(tiny_pair["target"], dtype="float64")
    engine = engine_of(target, make_drafter("model", load(tiny_pair["independent"], dtype="float64")), gamma=2,
                       policy="threshold", requests_choose_lengths=False)
    request = engine.new_request([1, 2, 3, 4], SamplingParams(max_new_tokens=20), row=0)
    assert request.policy is None and request.stop_early is None
    cache = target.new_cache(rows=1)
    engine.prefill([request], cache)
    [outcome] = engine.step([request], cache, [4])
    assert outcome.num_drafted == 4  # an independent draft: a threshold of 0.4 would have cut it
    with pytest.raises(ValueError, match="draft_lengths"):
        engine.step([request], cache)


def test_on_and_off_ignore_costs():
    assert lengths_for(SpeculationController("on", gamma=3), 32) == [3] * 32
    assert lengths_for(SpeculationController("off", gamma=3), 1) == [0]
    with pytest.raises(ValueError, match="speculation mode"):
        SpeculationController("sometimes", gamma=3)


def test_profile_measures_every_cell(tiny_pair):
    target = load(tiny_pair["target"])
    table = profile_verify_costs(target, [1, 2], [1, 3], context=8, repeats=1)
    assert set(table.cells) == {(1, 1), (1, 3), (2, 1), (2, 3)}
    assert all(cell.mean > 0 for cell in table.cells.values())


def test_verify_costs_are_measured_once_per_machine_and_model(tiny_pair, tmp_path, monkeypatch):
    """A server's second start takes no measurement (it was minutes on a 1.5B model); another
    model, precision or ISA cap is measured anew."""
    from specdec.serving import speculation

    measured = []
    real = speculation.profile_verify_costs
    monkeypatch.setattr(speculation, "profile_verify_costs",
                        lambda target, *args, **kw: measured.append(target.name) or real(target, *args, repeats=1))
    cache_file = tmp_path / "costs.json"
    target = load(tiny_pair["target"])
    first = speculation.cached_verify_costs(target, [1, 2], [1, 3], cache_file=cache_file)
    again = speculation.cached_verify_costs(target, [1, 2], [1, 3], cache_file=cache_file)
    assert measured == [target.name]
    assert {key: cell.mean for key, cell in again.cells.items()} == pytest.approx(
        {key: cell.mean for key, cell in first.cells.items()})
    speculation.cached_verify_costs(load(tiny_pair["target"], quantize="int8"), [1, 2], [1, 3], cache_file=cache_file)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    speculation.cached_verify_costs(target, [1, 2], [1, 3], cache_file=cache_file)
    assert len(measured) == 3


def collect(scheduler: Scheduler, prompt, sampling: SamplingParams, results: dict, done: threading.Event, key):
    def emit(item):
        if isinstance(item, BaseException):
            results[key] = item
        elif item.result is not None:
            results[key] = item.result.token_ids
        if len(results) == done.expected:
            done.set()

    return scheduler.submit(prompt, sampling, emit)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("kind, count, max_batch", [("model", 10, 4), ("tree", 10, 4),
                                                    pytest.param("model", 40, 32, marks=pytest.mark.slow)])
def test_requests_joining_a_running_batch_get_what_they_get_alone(tiny_pair, temperature, kind, count, max_batch):
    """Requests join and leave a running batch (up to 32 rows, drafting in lockstep): each gets
    the tokens it gets alone, greedy and seeded, chains and trees."""
    target = load(tiny_pair["target"], dtype="float64")
    drafter = make_drafter(kind, load(tiny_pair["perturbed"], dtype="float64"), tree_budget=6)
    prompts = batch_prompts(3, target.vocab_size, count=count)
    samplings = [SamplingParams(temperature=temperature, seed=index, max_new_tokens=8 + 3 * (index % 10))
                 for index in range(len(prompts))]
    alone = SpeculativeDecoder(target, drafter, gamma=3)
    expected = {i: alone.generate(p, s).token_ids for i, (p, s) in enumerate(zip(prompts, samplings, strict=True))}
    scheduler = Scheduler(engine_of(target, drafter, gamma=3), SpeculationController("on", 3),
                          max_batch=max_batch).start()
    results, done = {}, threading.Event()
    done.expected = len(prompts)
    try:
        for index, (prompt, sampling) in enumerate(zip(prompts, samplings, strict=True)):
            collect(scheduler, prompt, sampling, results, done, index)
            if index == 2:  # let the first ones run a few steps before the rest arrive
                while len(scheduler.running) < 3 and not results:
                    time.sleep(0.001)
        assert done.wait(120)
    finally:
        scheduler.stop()
    assert results == expected
    assert sorted(scheduler.free_rows) == list(range(max_batch))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_long_prompt_is_prefilled_in_pieces_between_the_running_streams_steps(tiny_pair, temperature):
    """A 100-token prompt arriving while 6 streams run goes in 8-token pieces, one per loop (the
    budget), each loop also stepping every running stream; every request, the long one too, gets
    what it gets alone from an engine with the same pieces (greedy and seeded samples). Mutation,
    checked: feeding the whole prompt once admitted (no budget) fails the piece counts."""
    target = load(tiny_pair["target"], dtype="float64")
    drafter = make_drafter("model", load(tiny_pair["perturbed"], dtype="float64"))
    long_prompt = [(7 * i + 3) % target.vocab_size for i in range(100)]
    prompts = [*batch_prompts(5, target.vocab_size, count=6), long_prompt]
    samplings = [SamplingParams(temperature=temperature, seed=index, max_new_tokens=20 if index == 6 else 60)
                 for index in range(7)]
    alone = SpeculativeDecoder(target, drafter, gamma=3, prefill_chunk=8)
    expected = {i: alone.generate(p, s).token_ids for i, (p, s) in enumerate(zip(prompts, samplings, strict=True))}
    engine = engine_of(target, drafter, gamma=3, prefill_chunk=8)
    scheduler = Scheduler(engine, SpeculationController("on", 3), max_batch=8, prefill=PrefillBudget(tokens=1))
    results, done = {}, threading.Event()
    done.expected = len(prompts)
    # The 6 streams wait before the loop starts, so they are admitted together; the long prompt comes
    # once all 6 are past their prefill (polling for 6 running at once could miss that moment: a
    # sampled stream may end a step after it starts).
    for index in range(6):
        collect(scheduler, prompts[index], samplings[index], results, done, index)
    scheduler.start()
    try:
        deadline = time.monotonic() + 60
        while scheduler.waiting or scheduler.prefilling or len(scheduler.running) + len(results) < 6:
            assert time.monotonic() < deadline, "the 6 streams were not all admitted"
            time.sleep(0.001)
        collect(scheduler, long_prompt, samplings[6], results, done, 6)
        assert done.wait(120)
    finally:
        scheduler.stop()
    assert results == expected
    beside_streams = [fed for fed, running in scheduler.prefill_chunks if running > 0]
    assert beside_streams.count(8) >= 12 and max(beside_streams) <= 8  # 99 tokens: 12 pieces of 8 and one of 3


def test_the_prefill_budget_is_a_share_of_a_decode_step_or_a_stated_latency_alone():
    budget = PrefillBudget(share=0.5)
    assert budget.next() == 1  # nothing measured yet: one piece
    budget.observe_step(0.020)
    budget.observe_prefill(tokens=100, seconds=0.050)  # 0.5 ms a token
    assert budget.next() == 20  # half of 20 ms
    assert budget.next(streams_running=False) == 500  # alone: 0.25 s of prefill a loop
    assert PrefillBudget(tokens=64).next() == 64
    with pytest.raises(ValueError, match="at least one token"):
        PrefillBudget(tokens=0)


class FailingDrafter:
    """Raises for a context that holds the token 0; drafts nothing otherwise."""

    hidden_layers: tuple[int, ...] = ()

    def start(self, prompt_ids):
        return None

    def propose(self, request, gamma):
        if 0 in request.context.tolist():
            raise RuntimeError("drafter exploded")
        from specdec.core.drafts import Draft

        return Draft.empty(request.context.device)

    def observe(self, request, outcome):
        pass


def test_a_failing_step_fails_its_requests_not_the_server(tiny_pair):
    target = load(tiny_pair["target"])
    scheduler = Scheduler(engine_of(target, FailingDrafter()), SpeculationController("on", 2), max_batch=2).start()
    results, done = {}, threading.Event()
    done.expected = 1
    try:
        collect(scheduler, [0, 5, 6], SamplingParams(max_new_tokens=4), results, done, "bad")
        assert done.wait(60) and isinstance(results["bad"], RuntimeError)
        done.clear()
        done.expected = 2
        collect(scheduler, [5, 6, 7], SamplingParams(max_new_tokens=4), results, done, "good")
        assert done.wait(60) and len(results["good"]) == 4
    finally:
        scheduler.stop()


def test_the_waiting_queue_is_bounded(tiny_pair):
    target = load(tiny_pair["target"])
    scheduler = Scheduler(engine_of(target), SpeculationController("off", 0), max_batch=1, max_waiting=2)
    for _ in range(2):  # not started: nothing leaves the queue
        scheduler.submit([1, 2], SamplingParams(), lambda item: None)
    with pytest.raises(QueueFullError, match="waiting"):
        scheduler.submit([1, 2], SamplingParams(), lambda item: None)
    with pytest.raises(ValueError, match="empty"):
        scheduler.submit([], SamplingParams(), lambda item: None)


def test_choices_of_one_prompt_are_admitted_together_and_forked():
    """submit_choices (OpenAI's n): the first prefills, the others start from its row; three greedy
    choices (three requests of one prompt and one setting, which once crashed the scheduler's
    search of its prefilled requests) give one text, seeded ones what they give alone. Mutation,
    checked: Request with dataclass field equality again fails it."""
    from table_lm import table_model

    target = table_model(6, seed=1)
    prompt = [1, 2, 3, 4, 5]
    alone = SpeculativeDecoder(target)
    for samplings in ([SamplingParams(max_new_tokens=6)] * 3,
                      [SamplingParams(temperature=1.0, seed=seed, max_new_tokens=6) for seed in (3, 4, 5)]):
        scheduler = Scheduler(engine_of(target), SpeculationController("off", 0), max_batch=4).start()
        results: dict = {}
        done = threading.Event()
        done.expected = 3

        def emit_to(index: int, results: dict = results, done: threading.Event = done):  # this round's, bound now
            def emit(item):
                if isinstance(item, BaseException) or item.result is not None:
                    results[index] = item if isinstance(item, BaseException) else item.result.token_ids
                if len(results) == 3:
                    done.set()
            return emit

        try:
            tickets = scheduler.submit_choices(prompt, samplings, [emit_to(index) for index in range(3)])
            assert done.wait(30)
        finally:
            scheduler.stop()
        assert [ticket.parent for ticket in tickets] == [None, tickets[0], tickets[0]]
        assert [results[index] for index in range(3)] == [alone.generate(prompt, s).token_ids for s in samplings]
