"""The scheduler feeds a long prompt in pieces whenever another request is admitted, prefilling
or decoding, and the outputs stay what each request gets alone. Deterministic: loops are driven
one by one here (no scheduler thread, no timing)."""

import dataclasses
import itertools
import threading

import pytest
from test_scheduling import collect

from specdec import SamplingParams, SpeculativeDecoder, load, make_drafter
from specdec.assembly import engine_of
from specdec.serving.scheduler import PrefillBudget, Scheduler
from specdec.serving.speculation import SpeculationController

CHUNK = 8


def one_loop(scheduler: Scheduler) -> None:
    """What Scheduler.loop does once: admit into free rows, then advance."""
    scheduler.advance(scheduler.admissible())


def make_scheduler(tiny_pair, max_batch=8, budget=CHUNK):
    target = load(tiny_pair["target"], dtype="float64")
    engine = engine_of(target, make_drafter("model", load(tiny_pair["perturbed"], dtype="float64")), gamma=3,
                    prefill_chunk=CHUNK)
    return Scheduler(engine, SpeculationController("on", 3), max_batch=max_batch,
                     prefill=PrefillBudget(tokens=budget))


def long_prompt(vocab_size: int, length: int = 100) -> list[int]:
    return [(7 * i + 3) % vocab_size for i in range(length)]


def test_a_long_prompt_admitted_beside_a_short_one_goes_in_pieces_and_the_short_one_starts_at_once(tiny_pair):
    """Nothing runs yet; a long and a short prompt are admitted in one loop. The short one is fed
    first and decodes from the first loop on; the long one gets at most the budget a loop.
    Mutation, checked: the old rule (no budget while nothing runs) feeds the long one whole."""
    scheduler = make_scheduler(tiny_pair)
    vocab = scheduler.engine.target.vocab_size
    long_ticket = scheduler.submit(long_prompt(vocab), SamplingParams(max_new_tokens=4), lambda item: None)
    short_ticket = scheduler.submit([5, 6, 7, 8], SamplingParams(max_new_tokens=40), lambda item: None)
    one_loop(scheduler)
    assert short_ticket in scheduler.running and short_ticket.request.length > 4  # prefilled and stepped
    fed = [long_ticket.request.fed]
    assert fed[0] <= CHUNK
    while long_ticket in scheduler.prefilling:
        one_loop(scheduler)
        fed.append(long_ticket.request.fed)
    assert max(b - a for a, b in itertools.pairwise(fed)) <= CHUNK
    assert len(fed) >= 4


def test_a_long_prompt_alone_goes_in_pieces_and_a_request_arriving_during_it_starts_at_the_next_loop(tiny_pair):
    """Nothing else runs or waits: the long prompt still gets one loop's budget at a time, so a
    short request submitted after its first loop is admitted, prefilled and stepped in the next
    one, while the long one is still prefilling. Mutation, checked: feeding a prompt admitted
    alone whole (the old rule) fails it."""
    scheduler = make_scheduler(tiny_pair)
    vocab = scheduler.engine.target.vocab_size
    long_ticket = scheduler.submit(long_prompt(vocab), SamplingParams(max_new_tokens=4), lambda item: None)
    one_loop(scheduler)
    assert long_ticket in scheduler.prefilling and long_ticket.request.fed <= CHUNK
    short_ticket = scheduler.submit([5, 6, 7, 8], SamplingParams(max_new_tokens=40), lambda item: None)
    one_loop(scheduler)
    assert short_ticket in scheduler.running and short_ticket.request.length > 4
    assert long_ticket in scheduler.prefilling


def test_a_burst_admitted_together_starts_together_and_a_long_prompt_among_it_waits_its_turn(tiny_pair):
    """With nothing running, one-piece prompts all go in at once (as before); the long one
    beside them gets the budget."""
    scheduler = make_scheduler(tiny_pair)
    vocab = scheduler.engine.target.vocab_size
    shorts = [scheduler.submit([3 + i, 4, 5], SamplingParams(max_new_tokens=30), lambda item: None) for i in range(5)]
    long_ticket = scheduler.submit(long_prompt(vocab), SamplingParams(max_new_tokens=4), lambda item: None)
    one_loop(scheduler)
    assert all(ticket in scheduler.running for ticket in shorts)
    assert long_ticket.request.fed <= CHUNK


def test_a_request_passed_over_goes_first_next_loop(tiny_pair):
    """A short prompt comes every loop, and a loop feeds one piece: the long one still moves
    every other loop (passed over once, it goes first). Mutation, checked: shortest first alone
    starves it."""
    scheduler = make_scheduler(tiny_pair, max_batch=32, budget=1)
    vocab = scheduler.engine.target.vocab_size
    scheduler.submit([1, 2, 3], SamplingParams(max_new_tokens=200), lambda item: None)
    one_loop(scheduler)  # something runs from now on
    long_ticket = scheduler.submit(long_prompt(vocab), SamplingParams(max_new_tokens=2), lambda item: None)
    fed = []
    for index in range(10):
        scheduler.submit([9, index + 1, 3, 4], SamplingParams(max_new_tokens=2), lambda item: None)
        one_loop(scheduler)
        fed.append(long_ticket.request.fed)
    assert all(b > a for a, b in itertools.pairwise(fed[::2])), fed


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_outputs_equal_alone_when_a_long_prompt_comes_with_a_burst(tiny_pair, temperature):
    """A long prompt submitted together with six short ones (nothing running yet): every request,
    the long one too, gets what it gets alone from an engine with the same pieces."""
    target = load(tiny_pair["target"], dtype="float64")
    drafter = make_drafter("model", load(tiny_pair["perturbed"], dtype="float64"))
    prompts = [long_prompt(target.vocab_size), *([4 + i, 9, 2 * i + 1] for i in range(6))]
    samplings = [SamplingParams(temperature=temperature, seed=index, max_new_tokens=12 + 5 * index)
                 for index in range(len(prompts))]
    alone = SpeculativeDecoder(target, drafter, gamma=3, prefill_chunk=CHUNK)
    expected = {i: alone.generate(p, s).token_ids for i, (p, s) in enumerate(zip(prompts, samplings, strict=True))}
    engine = engine_of(target, drafter, gamma=3, prefill_chunk=CHUNK)
    scheduler = Scheduler(engine, SpeculationController("on", 3), max_batch=8, prefill=PrefillBudget(tokens=CHUNK))
    results, done = {}, threading.Event()
    done.expected = len(prompts)
    for index, (prompt, sampling) in enumerate(zip(prompts, samplings, strict=True)):  # queued before the loop starts
        collect(scheduler, prompt, sampling, results, done, index)
    scheduler.start()
    try:
        assert done.wait(120)
    finally:
        scheduler.stop()
    assert results == expected
    # the budget, and the burst's one-piece prompts besides
    assert max(fed for fed, _ in scheduler.prefill_chunks) <= CHUNK + 6 * 2


@pytest.mark.parametrize("long_prompts", [2, 4])
def test_a_short_request_behind_several_long_prompts_waits_about_a_loop_per_prompt(tiny_pair, long_prompts):
    """While 2 (4) long prompts are fed a piece a loop beside a running stream, a short request
    gets its first token within long_prompts + 2 loops (one a prompt ahead of it, one to admit it
    and one for its own piece and first step), not once they are all in; the long ones
    still finish. Mutation, checked: the passed over in the order they came (the old rule) keeps
    it waiting past the bound, behind long prompts that take turns."""
    scheduler = make_scheduler(tiny_pair, budget=CHUNK)
    vocab = scheduler.engine.target.vocab_size
    scheduler.submit([1, 2, 3], SamplingParams(max_new_tokens=400), lambda item: None)
    one_loop(scheduler)  # a stream runs from now on
    longs = [scheduler.submit(long_prompt(vocab, 90 + index), SamplingParams(max_new_tokens=2), lambda item: None)
             for index in range(long_prompts)]
    for _ in range(3):  # the long prompts take turns
        one_loop(scheduler)
    assert all(ticket in scheduler.prefilling for ticket in longs)
    first_token = []
    short = scheduler.submit([5, 6, 7, 8], SamplingParams(max_new_tokens=3), lambda item: first_token.append(item))
    loops = 0
    while not first_token:
        one_loop(scheduler)
        loops += 1
        assert loops <= long_prompts + 2, f"the short request waited {loops} loops behind {long_prompts} prompts"
    assert short.request is None or short in scheduler.running or short.request.finish_reason is not None
    for _ in range(200):
        if not any(ticket in scheduler.prefilling for ticket in longs):
            break
        one_loop(scheduler)
    assert not any(ticket in scheduler.prefilling for ticket in longs)


def test_long_prompts_fed_together_end_one_after_another(tiny_pair):
    """Three long prompts fed a piece a loop beside a running stream: the one with the least left goes
    on while the others wait their turn, so the first ends about as soon as it would alone (not
    after three times its pieces, taking turns), and they end shortest first. Mutation, checked:
    the passed over all going first (taking turns) ends the first after ~3x its pieces."""
    scheduler = make_scheduler(tiny_pair, budget=CHUNK)
    vocab = scheduler.engine.target.vocab_size
    scheduler.submit([1, 2, 3], SamplingParams(max_new_tokens=400), lambda item: None)
    one_loop(scheduler)  # a stream runs from now on
    lengths = (90, 100, 110)
    longs = [scheduler.submit(long_prompt(vocab, length), SamplingParams(max_new_tokens=2), lambda item: None)
             for length in lengths]
    ended: dict[int, int] = {}
    for loop in range(1, 200):
        one_loop(scheduler)
        for index, ticket in enumerate(longs):
            if index not in ended and ticket not in scheduler.prefilling and ticket not in scheduler.waiting:
                ended[index] = loop
        if len(ended) == len(longs):
            break
    pieces = [-(-length // CHUNK) for length in lengths]
    assert ended[0] < ended[1] < ended[2], ended
    assert ended[0] <= pieces[0] + 3, (ended, pieces)  # taking turns: ~3 x 12 loops
    assert ended[2] <= sum(pieces) + 6, (ended, pieces)


def dry_pool_scheduler(model_dir, drafter_kind: str | None = None, gamma: int = 3, ends: bool = False):
    """A 13-block pool (416 tokens) over a random model of 512 positions that ends at its end
    token only where ``ends`` says (else every request runs its length)."""
    from tiny import save_random_model

    folder = save_random_model(model_dir / "pool-dry", "llama", seed=1, max_position_embeddings=512)
    target = load(folder, dtype="float64")
    target = target if ends else dataclasses.replace(target, eos_token_ids=())
    drafter = None if drafter_kind is None else make_drafter(drafter_kind, target)
    engine = engine_of(target, drafter, gamma=gamma, prefill_chunk=CHUNK)
    scheduler = Scheduler(engine, SpeculationController("on" if drafter else "off", gamma), max_batch=4,
                          prefill=PrefillBudget(tokens=CHUNK), pool_tokens=13 * 32)
    return scheduler, SpeculativeDecoder(target, drafter, gamma=gamma, prefill_chunk=CHUNK)


def run_until_idle(scheduler: Scheduler, loops: int = 3000) -> None:
    for _ in range(loops):
        if not (scheduler.waiting or scheduler.prefilling or scheduler.running):
            return
        one_loop(scheduler)
    raise AssertionError("the scheduler did not finish its requests")


def submit_collecting(scheduler: Scheduler, prompt: list[int], new_tokens: int, outputs: dict, index: int):
    return scheduler.submit(prompt, SamplingParams(max_new_tokens=new_tokens),
                            lambda item: outputs.setdefault(index, []).append(item))


def check_texts(outputs: dict, requests: list[tuple[list[int], int]], alone: SpeculativeDecoder) -> None:
    for index, (prompt, new_tokens) in enumerate(requests):
        items = outputs[index]
        assert not any(isinstance(item, BaseException) for item in items), (index, items)
        text = [token for item in items for token in item.token_ids]
        assert text == alone.generate(prompt, SamplingParams(max_new_tokens=new_tokens)).token_ids, index


def test_four_prompts_fed_at_once_into_a_small_pool_keep_their_blocks_and_all_finish(model_dir):
    """4 prompts of 90 tokens and 60 new each into a 13-block pool: each prompt's blocks are held
    from its admission to the end of its prefill (a commit gave them back before, the decoding
    requests took them, and the prompt's next piece failed: 500s in the server). Nothing fails
    and every greedy text equals its request's alone. Mutation, checked: the scheduler before
    (prompt blocks without a hold, the passed over fed in the order they came) fails two of them
    with CacheFullError."""
    scheduler, alone = dry_pool_scheduler(model_dir, ends=True)
    vocab = scheduler.engine.target.vocab_size
    requests = [([(7 * i + 3 + j) % vocab for i in range(90)], 60) for j in range(4)]
    outputs: dict[int, list] = {}
    for index, (prompt, new_tokens) in enumerate(requests):
        submit_collecting(scheduler, prompt, new_tokens, outputs, index)
    run_until_idle(scheduler)
    check_texts(outputs, requests, alone)


def test_when_the_pool_runs_dry_the_newest_goes_even_while_its_prompt_is_fed(model_dir):
    """A stream that accepts every draft (8 tokens a step) grows into the pool while a younger
    250-token prompt is fed beside it (8 tokens a loop): the younger one, still prefilling, is deferred (fed again
    from its prompt later), the older stream is never preempted, and both texts are as alone.
    Mutations, checked: make_room choosing among the running requests only fails the stream; the
    prompt's blocks taken without a hold (the old ensure) fail the younger with CacheFullError."""
    scheduler, alone = dry_pool_scheduler(model_dir, drafter_kind="model", gamma=7)
    vocab = scheduler.engine.target.vocab_size
    requests = [([(5 * i + 1) % vocab for i in range(30)], 200), ([(7 * i + 3) % vocab for i in range(250)], 20)]
    outputs: dict[int, list] = {}
    stream = submit_collecting(scheduler, *requests[0], outputs, 0)
    for _ in range(3):
        one_loop(scheduler)
    younger = submit_collecting(scheduler, *requests[1], outputs, 1)
    run_until_idle(scheduler)
    check_texts(outputs, requests, alone)
    assert stream.preempted == 0 and younger.preempted >= 1
