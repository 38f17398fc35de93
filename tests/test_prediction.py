"""Predicted outputs (OpenAI's ``prediction``): the prediction drafter follows where the output is
in the predicted text through edits, drafts nothing without a prediction, and is lossless like
every drafter (greedy identity alone and as auto's candidate, the coupled rule's text, the sampled
law); the counts reach the stats, the JSON and the server's usage."""

import json
import random

import pytest
import torch

from specdec import SamplingParams, SpeculativeDecoder, load, make_drafter
from specdec.core.drafts import ContextRequest, StepOutcome
from specdec.drafting.prediction import PREDICTION, PredictionDrafter


def steps_through(drafter: PredictionDrafter, output: list[int], predicted: list[int],
                  gamma: int = 8) -> list[tuple[int, int]]:
    """Step the drafter over ``output`` as a verifier would (the draft's agreeing prefix accepted,
    then the output's next token); returns each step's (drafted, accepted)."""
    request = ContextRequest.started(drafter, torch.tensor([1, 2]),
                                     sampling=SamplingParams(prediction=tuple(predicted)))
    done, steps = 0, []
    while done < len(output):
        draft = drafter.propose(request, gamma).tokens.tolist()
        agree = next((j for j, token in enumerate(draft) if done + j >= len(output) or token != output[done + j]),
                     len(draft))
        emitted = output[done : done + agree + 1]
        drafter.observe(request, StepOutcome(torch.tensor(emitted), len(draft)))
        steps.append((len(draft), agree))
        done += len(emitted)
    return steps


def run_through(drafter: PredictionDrafter, output: list[int], predicted: list[int], gamma: int = 8) -> list[int]:
    """How many tokens each step of steps_through accepted."""
    return [accepted for _, accepted in steps_through(drafter, output, predicted, gamma)]


def lines(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 500) for _ in range(6)] + [1] for _ in range(count)]


def flat(rows: list[list[int]]) -> list[int]:
    return [token for row in rows for token in row]


def test_a_prediction_that_holds_is_copied_in_growing_blocks():
    """Twice as far as it has held: 2 at first, then 2 * 3 after 3 emitted, then gamma."""
    predicted = flat(lines(20))
    accepted = run_through(PredictionDrafter(), predicted, predicted, gamma=16)
    assert accepted[:4] == [2, 6, 16, 16] and sum(accepted) >= len(predicted) - len(accepted)


def test_its_draft_grows_on_steps_that_another_drafter_drafted():
    """As auto's candidate it hears of the steps another copy drafted (num_drafted 0 for it): the
    tokens that followed the prediction there count, so its next guess is long (a length grown
    only on its own steps stayed at 2, and auto never chose it on whole-file edits)."""
    predicted = flat(lines(6))
    drafter = PredictionDrafter()
    request = ContextRequest.started(drafter, torch.tensor([1]), sampling=SamplingParams(prediction=tuple(predicted)))
    for start in range(0, 12, 4):  # three steps of 4 tokens, drafted by someone else
        drafter.observe(request, StepOutcome(torch.tensor(predicted[start : start + 4]), 0))
    assert drafter.propose(request, 16).tokens.tolist() == predicted[12:28]
    drafter.observe(request, StepOutcome(torch.tensor([9999]), 0))  # the output leaves it: lost, no draft
    assert len(drafter.propose(request, 16).tokens) == 0


@pytest.mark.parametrize("edit", ["insert", "delete", "replace"])
def test_after_an_edit_it_joins_the_prediction_again(edit):
    """The output departs from the prediction at line 5 (a line inserted, deleted, or replaced)
    and follows it afterwards: after the edit, the drafter copies again within a few tokens.
    Mutations, checked: rejoin returning None (never rejoining) fails it; an off-by-one in the
    re-anchoring (the pointer one past where the output joins) fails 4 of these cases."""
    rows = lines(16)
    output_rows = {"insert": rows[:5] + lines(1, seed=9) + rows[5:], "delete": rows[:5] + rows[6:],
                   "replace": rows[:5] + lines(1, seed=9) + rows[6:]}[edit]
    drafter = PredictionDrafter()
    accepted = run_through(drafter, flat(output_rows), flat(rows), gamma=8)
    # all but a few steps around the edit copy: most tokens come accepted
    assert sum(accepted) >= len(flat(output_rows)) - 3 * 7 - len(accepted)
    assert max(accepted[-3:]) >= 4  # copying long blocks again at the end


def named_lines(count: int, renamed: int) -> tuple[list[int], list[int]]:
    """(prediction, output): lines that each use name 600 (the prediction), and the same lines
    where the first ``renamed`` have it renamed to 600 601 (one token added after it)."""
    rows = lines(count, seed=5)
    predicted = flat([row[:2] + [600] + row[2:] for row in rows])
    output = flat([row[:2] + [600, 601] + row[2:] if n < renamed else row[:2] + [600] + row[2:]
                   for n, row in enumerate(rows)])
    return predicted, output


def misses(steps: list[tuple[int, int]]) -> list[int]:
    """The steps whose draft was refused somewhere."""
    return [n for n, (drafted, accepted) in enumerate(steps) if accepted < drafted]


def test_an_edit_made_once_is_made_ahead_in_later_copies():
    """A name renamed on every line: after the first line the drafter has learned the edit and
    drafts it at every later use, so no later step is refused (mutation checked: without learning,
    each line's use of the name is refused, 12 misses)."""
    predicted, output = named_lines(12, renamed=12)
    steps = steps_through(PredictionDrafter(), output, predicted, gamma=8)
    assert len(misses(steps)) <= 2, steps


def test_an_edit_the_output_does_not_repeat_is_forgotten():
    """The name renamed on the first line only: the edit learned there is refused once at the next
    use, forgotten, and the rest copies plainly (mutation checked: keeping a refused edit misses on
    every line)."""
    predicted, output = named_lines(12, renamed=1)
    steps = steps_through(PredictionDrafter(), output, predicted, gamma=8)
    assert len(misses(steps)) <= 3, steps


def test_a_repeated_line_rejoins_at_the_occurrence_the_output_is_at():
    """Lines A B A C: after a change inside the second A, the drafter rejoins at the second A's
    rest (the longer agreement and the nearest ahead), so C follows, not B."""
    a, b, c = lines(3, seed=3)
    predicted = a + b + a + c
    changed = a[:3] + [777] + a[4:]
    output = a + b + changed + c
    drafter = PredictionDrafter(min_match=2)
    request = ContextRequest.started(drafter, torch.tensor([1]), sampling=SamplingParams(prediction=tuple(predicted)))
    drafter.observe(request, StepOutcome(torch.tensor(output[: len(a) + len(b) + len(changed)]), 0))
    draft = drafter.propose(request, 4).tokens.tolist()  # (short: the output left the prediction lately)
    assert draft and draft == c[: len(draft)]


def test_no_prediction_no_draft():
    drafter = PredictionDrafter()
    request = ContextRequest.started(drafter, torch.tensor([1, 2, 3]))
    assert drafter.propose(request, 8).num_nodes == 0


@pytest.fixture(scope="module")
def target(tiny_pair):
    return load(tiny_pair["target"], dtype="float64")


def predictions_of(expected: list[int], rng: random.Random, vocab: int) -> dict[str, list[int]]:
    """The target's own output, the same edited (a replaced token, an inserted and a deleted run),
    and garbage."""
    edited = list(expected)
    if len(edited) > 6:
        edited[2] = (edited[2] + 1) % vocab
        edited[5:5] = [rng.randrange(vocab) for _ in range(3)]
        del edited[-3:]
    return {"exact": expected, "edited": edited, "garbage": [rng.randrange(vocab) for _ in range(len(expected))]}


def test_greedy_output_is_the_targets_whatever_the_prediction(target):
    """The prediction drafter alone and as auto's candidate, over exact, edited and garbage
    predictions: every output equals the target alone's, and an exact prediction is accepted."""
    from test_greedy_equality import random_cases

    alone = SpeculativeDecoder(target)
    rng = random.Random(5)
    accepted = 0
    for prompt, max_new_tokens, gamma in random_cases(11, target.vocab_size, 12):
        expected = alone.generate(prompt, max_new_tokens=max_new_tokens).token_ids
        for kind, predicted in predictions_of(expected, rng, target.vocab_size).items():
            for drafter in ("prediction", "auto"):
                decoder = SpeculativeDecoder(target, drafter, gamma=max(gamma, 4))
                result = decoder.generate(prompt, max_new_tokens=max_new_tokens, prediction=predicted)
                assert result.token_ids == expected, (drafter, kind, prompt)
                if kind == "exact" and drafter == "prediction":
                    accepted += result.stats.prediction_tokens[0]
    assert accepted > 0


def test_the_coupled_rule_gives_the_target_alone_text_with_a_prediction(target):
    alone = SpeculativeDecoder(target)
    decoder = SpeculativeDecoder(target, "auto")
    for seed in range(6):
        sampling = SamplingParams(temperature=0.8, seed=seed, max_new_tokens=16)
        expected = alone.generate([3, 4, 5, 3, 4], sampling).token_ids
        with_prediction = SamplingParams(temperature=0.8, seed=seed, max_new_tokens=16, prediction=tuple(expected))
        assert decoder.generate([3, 4, 5, 3, 4], with_prediction).token_ids == expected


@pytest.mark.slow
def test_the_sampled_law_with_a_prediction(tmp_path_factory):
    """Chi-square of 20k seeded 3-token generations against the enumerated law of a 6-token target,
    drafted from a prediction (rejection sampling, point masses)."""
    from law import assert_matches_law, sample_sequences
    from test_heads import exact_law
    from tiny import save_random_model

    folder = save_random_model(tmp_path_factory.mktemp("six"), vocab_size=6, seed=5, init_scale=0.5,
                               tokenizer=False, bos_token_id=None, eos_token_id=None)
    six = load(folder, dtype="float64")
    prompt = [1, 4, 2, 1, 4]
    sampling = SamplingParams(temperature=0.9, prediction=(2, 1, 4))
    decoder = SpeculativeDecoder(six, make_drafter(PREDICTION), gamma=3)
    counts, accepted, drafted = sample_sequences(decoder, prompt, sampling, 3, 20000)
    assert 0 < accepted < drafted
    assert_matches_law(counts, exact_law(six, prompt, 3, SamplingParams(temperature=0.9)), "prediction")


def test_the_command_line_takes_a_prediction_file(tiny_pair, tmp_path, capsys):
    from specdec.commands.cli import main

    base = ["generate", "--target", str(tiny_pair["target"]), "abc abc abc", "--max-new-tokens", "12", "--json"]
    assert main([*base, "--no-draft"]) == 0
    expected = json.loads(capsys.readouterr().out)
    (tmp_path / "expected.txt").write_text(expected["text"])
    assert main([*base, "--prediction", str(tmp_path / "expected.txt"), "--drafter", "prediction"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["text"] == expected["text"]
    assert result["accepted_prediction_tokens"] > 0
    assert main([*base, "--prediction", str(tmp_path / "expected.txt"), "--drafter", "ngram"]) == 2
    assert "--prediction does not apply to --drafter ngram" in capsys.readouterr().err
    assert main([*base, "--prediction", str(tmp_path / "missing.txt")]) == 2


def test_the_server_takes_openais_prediction_and_reports_its_tokens():
    """Chat through the openai client with ``prediction`` (OpenAI's shape, text parts too): the
    answer is the one without it, and usage.completion_tokens_details counts the accepted and
    rejected prediction tokens, in the body and in a stream's usage chunk; /completions takes it
    too. Mutation, checked: usage without the prediction counts reads 0 accepted and fails."""
    import openai

    from specdec.defaults import default_model
    from specdec.serving.in_thread import serve_in_thread
    from specdec.serving.server import build_app

    toy = load(default_model("target"), dtype="float64")
    app = build_app(toy, make_drafter(PREDICTION), "toy", gamma=8, speculation="on", max_batch=2)
    messages = [{"role": "user", "content": "def add(a, b):"}]
    with serve_in_thread(app) as url:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        plain = api.chat.completions.create(model="toy", messages=messages, max_tokens=24, temperature=0)
        expected = plain.choices[0].message.content
        assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
        edited = expected[:10] + "x" + expected[11:]
        for prediction in ({"type": "content", "content": expected},
                           {"type": "content", "content": [{"type": "text", "text": edited[:5]},
                                                           {"type": "text", "text": edited[5:]}]}):
            answer = api.chat.completions.create(model="toy", messages=messages, max_tokens=24, temperature=0,
                                                 prediction=prediction)
            assert answer.choices[0].message.content == expected
            details = answer.usage.completion_tokens_details
            assert details.accepted_prediction_tokens > 0
        assert details.rejected_prediction_tokens > 0  # the edited prediction's changed character
        chunks = list(api.chat.completions.create(model="toy", messages=messages, max_tokens=24, temperature=0,
                                                  prediction={"type": "content", "content": expected}, stream=True,
                                                  stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
        assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 0
        completion = api.completions.create(model="toy", prompt="def add(a, b):", max_tokens=16, temperature=0)
        predicted = api.completions.create(model="toy", prompt="def add(a, b):", max_tokens=16, temperature=0,
                                           extra_body={"prediction": {"type": "content",
                                                                      "content": completion.choices[0].text}})
        assert predicted.choices[0].text == completion.choices[0].text
        assert predicted.usage.completion_tokens_details.accepted_prediction_tokens > 0
        with pytest.raises(openai.BadRequestError, match="only text parts"):
            api.chat.completions.create(model="toy", messages=messages, max_tokens=4,
                                        prediction={"type": "content", "content": [{"type": "image_url"}]})


def test_the_predicted_edits_suite():
    """At least 24 files of 60-400 lines from several packages, each the prompt's file and its
    prediction, with instructions of several kinds; the off-by-one file differs from its source
    in the one line it names."""
    import importlib
    import inspect

    from specdec.bench.predicted_edits import predicted_edits_suite
    from specdec.bench.suite import suite_prompts

    suite = suite_prompts("predicted-edits")
    assert len(suite) >= 24 and len({prompt.id.split(".")[0] for prompt in suite}) >= 10
    assert len({prompt.category for prompt in suite}) >= 6
    for prompt in suite:
        assert 60 <= prompt.prediction.count("\n") <= 400 and f"```python\n{prompt.prediction}```" in prompt.text
        source = inspect.getsource(importlib.import_module(prompt.id))
        changed = [a for a, b in zip(source.splitlines(), prompt.prediction.splitlines(), strict=True) if a != b]
        assert len(changed) == (1 if prompt.category == "off-by-one" else 0), prompt.id
    assert prompt.settings(SamplingParams()).prediction == prompt.prediction
    assert predicted_edits_suite()[0].text == suite[0].text  # the same suite on every call


def test_tokens_copied_from_the_prediction_are_marked(target):
    """generate --show colours them (TokenSource.PREDICTION), as the stream's sources say."""
    from specdec.text import TokenSource

    alone = SpeculativeDecoder(target).generate([3, 4, 5, 6], max_new_tokens=16).token_ids
    chunks = list(SpeculativeDecoder(target, PREDICTION, gamma=6).stream([3, 4, 5, 6], max_new_tokens=16,
                                                                        prediction=alone))
    marked = sum(source == TokenSource.PREDICTION for chunk in chunks for source in chunk.sources)
    assert marked == chunks[-1].result.stats.prediction_tokens[0] > 0


def test_the_counts_are_what_the_drafter_proposed_and_the_target_kept(target):
    """With the prediction drafter alone every draft is the prediction's: its accepted and
    rejected counts add up to the drafted tokens, the accepted ones to the accepted; an empty
    prediction drafts nothing and changes nothing."""
    alone = SpeculativeDecoder(target).generate([7, 8, 9], max_new_tokens=20).token_ids
    decoder = SpeculativeDecoder(target, PREDICTION, gamma=6)
    edited = alone[:5] + [(alone[5] + 1) % target.vocab_size] + alone[6:]
    result = decoder.generate([7, 8, 9], max_new_tokens=20, prediction=edited)
    accepted, rejected = result.stats.prediction_tokens
    assert result.token_ids == alone and (accepted, accepted + rejected) == (result.stats.accepted,
                                                                              result.stats.drafted)
    assert rejected > 0 and accepted > 0
    for empty in ((), ""):
        result = decoder.generate([7, 8, 9], max_new_tokens=20, prediction=empty)
        assert result.token_ids == alone and result.stats.drafted == 0


def test_bench_methods_without_or_with_an_unrelated_prediction(target):
    """auto@noprediction drops the prompt's prediction; @unrelated puts another file's text in its
    place (the cost of a wrong prediction); the plain method keeps it."""
    from specdec.bench.suite import make_method

    expected = SpeculativeDecoder(target).generate([7, 8, 9], max_new_tokens=16).token_ids
    settings = SamplingParams(max_new_tokens=16, prediction=tuple(expected))
    outputs = {flag: make_method(f"prediction:fixed{flag}", target, None, 6).run([7, 8, 9], settings)
               for flag in ("", "@noprediction", "@unrelated")}
    assert all(output.token_ids == expected for output in outputs.values())
    assert outputs[""].stats.prediction_tokens[0] > 0 and outputs["@noprediction"].stats.drafted == 0
    assert outputs["@unrelated"].stats.prediction_tokens[0] < outputs[""].stats.prediction_tokens[0]


def test_the_usage_counts_the_predictions_tokens_as_openai_defines_them():
    """accepted_prediction_tokens: the prediction's tokens that appear in the completion (in
    order); rejected_prediction_tokens: the rest of the prediction, whatever was drafted. A
    prediction equal to the answer: all accepted; with a line inserted and one deleted: the
    inserted line's tokens rejected, the deleted line's missing from the accepted."""
    import openai

    from specdec.defaults import default_model
    from specdec.serving.in_thread import serve_in_thread
    from specdec.serving.server import build_app

    toy = load(default_model("target"), dtype="float64")
    app = build_app(toy, make_drafter(PREDICTION), "toy", gamma=8, speculation="on", max_batch=2)
    with serve_in_thread(app) as url:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        plain = api.completions.create(model="toy", prompt="def add(a, b):", max_tokens=40, temperature=0)
        expected = plain.choices[0].text
        lines = expected.split("\n")
        assert len(lines) >= 3, expected
        answer_tokens = toy.tokenizer.encode(expected, add_special_tokens=False)

        def details(prediction: str):
            answer = api.completions.create(model="toy", prompt="def add(a, b):", max_tokens=40, temperature=0,
                                            extra_body={"prediction": {"type": "content", "content": prediction}})
            assert answer.choices[0].text == expected
            return answer.usage.completion_tokens_details

        same = details(expected)
        assert (same.accepted_prediction_tokens, same.rejected_prediction_tokens) == (len(answer_tokens), 0)
        deleted, inserted = lines[1], "    zebra_quokka = 12345"
        edited = "\n".join([lines[0], inserted, *lines[2:]])
        counts = details(edited)
        predicted_tokens = len(toy.tokenizer.encode(edited, add_special_tokens=False))
        assert counts.accepted_prediction_tokens + counts.rejected_prediction_tokens == predicted_tokens
        assert counts.rejected_prediction_tokens >= len(toy.tokenizer.encode("zebra_quokka = 12345",
                                                                             add_special_tokens=False)) - 2
        missing = len(answer_tokens) - counts.accepted_prediction_tokens
        assert 1 <= missing <= len(toy.tokenizer.encode(deleted, add_special_tokens=False)) + 2
