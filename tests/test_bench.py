"""`specdec bench` on tiny models: JSON, markdown and the greedy identity check."""

import json

import pytest

from specdec.bench.runner import IdentityError, Method, MethodOutput, Prompt, run_side_by_side
from specdec.commands.cli import main
from specdec.core.sampling import SamplingParams


@pytest.fixture()
def prompt_file(tmp_path):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps([
        {"category": "code", "prompt": "def f(x): return x + 1\ndef g(x): return", "id": "a"},
        {"category": "text", "prompt": "abc abc abc abc", "id": "b"},
    ]))
    return path


@pytest.mark.slow
def test_bench_writes_json_and_markdown(tiny_pair, prompt_file, tmp_path, capsys):
    out = tmp_path / "bench"
    code = main(["bench", "--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["perturbed"]),
                 "--prompts", str(prompt_file), "--methods", "model:fixed", "ngram:cost", "staged:threshold",
                 "--max-new-tokens", "12", "--out", str(out), "--repeats", "3"])
    assert code == 0
    payload = json.loads((out / "results.json").read_text())
    assert payload["greedy_identity_checked"] is True and payload["repeats"] == 3
    for row in payload["measurements"]:  # each prompt timed three times, the median kept
        assert len(row["timings"]) == 3 and row["seconds"] == sorted(row["timings"])[1]
    overall = {s["method"]: s for s in payload["summaries"] if s["category"] == "all"}
    assert set(overall) == {"target-only", "model:fixed", "ngram:cost", "staged:threshold"}
    assert overall["target-only"]["tau"] == 1.0 and overall["target-only"]["speedup"]["target-only"] == 1.0
    assert overall["model:fixed"]["alpha"] is not None and overall["model:fixed"]["tokens"] > 0
    assert {s["category"] for s in payload["summaries"]} == {"code", "text", "all"}
    assert len(payload["measurements"]) == 2 * 4
    assert "| model:fixed |" in (out / "results.md").read_text()
    assert (out / "results.png").stat().st_size > 1000
    assert not (out / "pass_at_1.png").exists()  # no outputs were tested: no pass@1 to plot
    assert "identity check passed" in " ".join(capsys.readouterr().err.split())  # said under the table


def test_sampled_bench_checks_identity_under_the_coupled_rule(tiny_pair, prompt_file, tmp_path, capsys):
    """A seeded sampled bench (coupled by default) checks every specdec method against target-only
    token for token; with rejection sampling it says that it did not check."""
    base = ["bench", "--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["perturbed"]), "--prompts",
            str(prompt_file), "--methods", "model:cost", "tree:tree-cost", "--max-new-tokens", "10", "--repeats", "1",
            "--temperature", "0.9"]
    assert main(base + ["--out", str(tmp_path / "coupled")]) == 0
    payload = json.loads((tmp_path / "coupled" / "results.json").read_text())
    assert payload["coupled_identity_checked"] is True and payload["mismatches"] == []
    assert "identity check passed" in " ".join(capsys.readouterr().err.split())
    assert main(base + ["--sampling-rule", "rejection", "--out", str(tmp_path / "rejection")]) == 0
    assert "identity not checked" in " ".join(capsys.readouterr().err.split())


def test_a_speedup_above_tau_is_flagged_as_noise():
    from specdec.bench.runner import Summary
    from specdec.commands.bench import impossible_speedups
    from specdec.core.metrics import SpecStats

    stats = SpecStats()
    stats.observe(0, 0)  # one plain step: tau 1.0
    stats.generated_tokens = 1
    noisy = Summary("ngram:cost", "specdec", "all", 8, 96, 1.0, stats, speedups={"target-only": 2.5})
    honest = Summary("ngram:cost", "specdec", "all", 8, 96, 1.0, stats, speedups={"target-only": 1.02})
    assert "2.50x at tau 1.00 is impossible" in impossible_speedups([noisy])[0]
    assert impossible_speedups([honest]) == []


def test_identity_check_fails_on_a_wrong_method(tiny_pair):
    from specdec import SpeculativeDecoder, load
    from specdec.bench.runner import speculative_method

    target = load(tiny_pair["target"])
    reference = speculative_method("target-only", SpeculativeDecoder(target))

    def off_by_one(prompt_ids, settings):
        output = reference.run(prompt_ids, settings)
        return MethodOutput([t + 1 for t in output.token_ids], output.seconds)

    prompts = [Prompt("code", "x"), Prompt("code", "y")]
    settings = SamplingParams(max_new_tokens=6, seed=0)
    encode = lambda text: [ord(text) % 90 + 3]  # noqa: E731
    seen = []
    run = run_side_by_side(
        [reference, Method("wrong", off_by_one)],
        prompts,
        encode,
        settings,
        "target-only",
        margin=lambda prompt_ids, before: 0.5,
        on_prompt=lambda so_far: seen.append(len(so_far.measurements)),
    )
    assert seen == [2, 4]  # results after every prompt
    assert len(run.measurements) == 4 and run.failed_methods == ["wrong"]  # the run completed
    assert [(m.prompt, m.position, m.margin) for m in run.mismatches] == [("0", 0, 0.5), ("1", 0, 0.5)]
    with pytest.raises(IdentityError, match="wrong on prompt 0"):
        run.raise_on_mismatch()
    # the same method marked lossy is reported, not failed
    assert not run_side_by_side(
        [reference, Method("wrong", off_by_one, lossless=False)], prompts, encode, settings, "target-only"
    ).mismatches
    # a method of another engine is checked against that engine's reference only
    other = [
        reference,
        Method("other-reference", off_by_one, engine="other"),
        Method("other", off_by_one, engine="other"),
    ]
    assert not run_side_by_side(
        other,
        prompts,
        encode,
        settings,
        "target-only",
        references={"specdec": "target-only", "other": "other-reference"},
    ).mismatches


@pytest.mark.slow
def test_bench_runs_transformers_methods(tiny_pair, prompt_file, tmp_path):
    out = tmp_path / "bench-hf"
    code = main(["bench", "--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["perturbed"]), "--prompts",
                 str(prompt_file), "--methods", "model:fixed", "transformers-generate", "transformers-assisted",
                 "transformers-assisted:3", "transformers-assisted:heuristic", "transformers-prompt-lookup",
                 "transformers-prompt-lookup:3", "--max-new-tokens", "10", "--out", str(out)])
    assert code == 0  # the identity check passed for transformers' methods too
    overall = {
        s["method"]: s for s in json.loads((out / "results.json").read_text())["summaries"] if s["category"] == "all"
    }
    assert overall["transformers-assisted"]["engine"] == "transformers"
    assert "transformers-generate" in overall["model:fixed"]["speedup"]


def test_bundled_prompt_suite_has_four_categories_of_at_least_15():
    from collections import Counter

    from specdec.bench.suite import load_prompts
    from specdec.defaults import default_prompts

    prompts = load_prompts(default_prompts())
    counts = Counter(p.category for p in prompts)
    assert set(counts) == {"code-completion", "code-editing", "docstrings", "structured"}
    assert min(counts.values()) >= 15
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(p.text.strip() for p in prompts)
    # code-editing prompts are input-grounded: they hold the code to rewrite
    assert all(p.text.count("\n") >= 5 for p in prompts if p.category == "code-editing")
    assert len(load_prompts(default_prompts(), per_category=2)) == 8


def test_transformers_method_settings():
    from specdec.bench.suite import transformers_options

    assert transformers_options("transformers-assisted:4")["assistant"]["num_assistant_tokens"] == 4
    assert transformers_options("transformers-assisted:heuristic")["assistant"] == {
        "num_assistant_tokens_schedule": "heuristic"
    }
    assert transformers_options("transformers-prompt-lookup") == {"prompt_lookup_num_tokens": 10}
    assert transformers_options("transformers-prompt-lookup:3") == {"prompt_lookup_num_tokens": 3}
    for bad in (
        "transformers-assisted:x",
        "transformers-generate:2",
        "transformers-prompt-lookup:many",
        "transformers-beam",
    ):
        with pytest.raises(ValueError):
            transformers_options(bad)


def test_a_failing_method_fails_the_command_after_every_result_is_written(
    tiny_pair, prompt_file, tmp_path, monkeypatch
):
    from specdec.bench import suite

    build = suite.build_methods

    def with_a_wrong_method(*args, **kwargs):
        methods = build(*args, **kwargs)
        reference = methods[0]

        def off_by_one(prompt_ids, settings):
            output = reference.run(prompt_ids, settings)
            return MethodOutput([t + 1 for t in output.token_ids], output.seconds)

        return [*methods, Method("wrong", off_by_one)]

    monkeypatch.setattr(suite, "build_methods", with_a_wrong_method)
    out = tmp_path / "bench-fail"
    code = main(["bench", "--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["perturbed"]), "--prompts",
                 str(prompt_file), "--methods", "model:fixed", "--max-new-tokens", "6", "--out", str(out)])
    results = json.loads((out / "results.json").read_text())
    assert code == 1 and results["complete"] and results["failed_methods"] == ["wrong"]
    assert {m["method"] for m in results["measurements"]} == {"target-only", "model:fixed", "wrong"}
    assert results["mismatches"][0]["margin"] is not None  # the target's top-2 margin at the divergence
    assert "greedy identity failures" in (out / "results.md").read_text()


@pytest.mark.slow
def test_bench_serve_replays_conversations_with_the_cache_on_and_off(tmp_path):
    """`specdec bench-serve --workload replay --compare-cache` on the default pair: each server has
    its own suffix cache; the second round replays the first, so the cached server's drafts come
    from the cache there, the other's never; greedy texts agree across servers (else exit 1)."""
    out = tmp_path / "serve"
    assert main(["bench-serve", "--drafter", "suffix", "--workload", "replay", "--turns", "2", "--concurrency", "1",
                 "--requests", "1", "--repeats", "2", "--max-new-tokens", "16", "--modes", "on", "--compare-cache",
                 "--out", str(out)]) == 0
    result = json.loads((out / "serve.json").read_text())
    rows = {row["mode"]: row for row in result["rows"]}
    assert set(rows) == {"on", "on, no cache"} and result["turns"] == 2 and not result["mismatches"]
    assert rows["on, no cache"]["rounds_accepted_from_cache"] == [0.0, 0.0]
    first_round, replay = rows["on"]["rounds_accepted_from_cache"]
    assert replay > max(0.2, first_round)


def test_bench_chat_wraps_every_prompt_in_the_chat_template(tiny_pair, prompt_file, tmp_path, monkeypatch):
    """--chat: every method gets the prompt as a user message through the target's chat template
    (the toy tokenizer has none: "user: ...\\nassistant:")."""
    import specdec.bench.suite as suite

    seen = []

    class Captured(Exception):
        pass

    def capture(target, draft, methods, prompts, *args, **kwargs):
        seen.extend(prompts)
        raise Captured  # enough: the prompts as the methods would get them

    monkeypatch.setattr(suite, "run_bench", capture)
    with pytest.raises(Captured):
        main(["bench", "--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["perturbed"]), "--chat",
              "--prompts", str(prompt_file), "--methods", "ngram:cost", "--out", str(tmp_path / "bench")])
    assert [prompt.text for prompt in seen] == ["user: def f(x): return x + 1\ndef g(x): return\nassistant:",
                                               "user: abc abc abc abc\nassistant:"]


def constrained_suite(path, count: int = 2) -> str:
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "ok"],
              "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}}}
    prompts = [{"category": "json", "id": f"j{i}", "prompt": f"def f{i}(x):", "json_schema": schema}
               for i in range(count)]
    path.write_text(json.dumps(prompts))
    return str(path)


def test_bench_on_a_constrained_suite_checks_outputs_and_forced_drafts(tmp_path, capsys):
    """Per-prompt JSON schemas: every method follows them (validity in the JSON), target-only@unforced
    pays a forward per forced token and gives the same tokens (the identity check), and a
    llama.cpp method is refused before anything runs."""
    from specdec.defaults import default_model

    suite = constrained_suite(tmp_path / "json.json")
    out = tmp_path / "bench"
    target, draft = str(default_model("target")), str(default_model("draft"))  # a tokenizer llguidance reads
    assert main(["bench", "--target", target, "--draft", draft, "--prompts", suite, "--max-new-tokens", "40",
                 "--methods", "target-only@unforced", "ngram:cost",
                 "--out", str(out)]) == 0
    measurements = json.loads((out / "results.json").read_text())["measurements"]
    assert {m["method"] for m in measurements} == {"target-only", "target-only@unforced", "ngram:cost"}
    assert all(m["valid"] is not None and m["grammar_seconds"] > 0 for m in measurements)
    forwards = {m["method"]: m["target_forwards"] for m in measurements if m["prompt"] == "j0"}
    forced = {m["method"]: m["forced_tokens"] for m in measurements if m["prompt"] == "j0"}
    assert forced["target-only"] > 0 and forced["target-only@unforced"] == 0
    assert forwards["target-only"] == forwards["target-only@unforced"] - forced["target-only"]
    capsys.readouterr()
    assert main(["bench", "--target", target, "--prompts", suite, "--methods", "transformers-generate"]) != 0
    err = capsys.readouterr().err
    assert "cannot follow the prompts' JSON schemas" in err and "loading models" not in err


@pytest.mark.slow
def test_bench_serve_json_workload_sends_schemas_through_response_format(tmp_path):
    """`specdec bench-serve --workload json` on the default pair: chat requests with response_format
    json_schema, every answer valid, the same greedy text with speculation on and off."""
    out = tmp_path / "serve"
    assert main(["bench-serve", "--workload", "json", "--prompts", constrained_suite(tmp_path / "json.json"),
                 "--concurrency", "2", "--requests", "2", "--repeats", "1", "--max-new-tokens", "40",
                 "--modes", "off", "on", "--out", str(out)]) == 0
    result = json.loads((out / "serve.json").read_text())
    assert result["workload"] == "json" and not result["mismatches"]
    assert all(row["valid_share"] == 1.0 for row in result["rows"])


def test_repeats_find_the_suffix_cache_as_the_first_run_did(tiny_pair):
    """Each repeat of a prompt starts from the cross-request cache the first run found: it does not
    copy the first run's own output (mutation checked: without forgetting, the repeats draft the
    whole output from the cache and accept far more than the first run)."""
    from specdec import SpeculativeDecoder, load, make_drafter
    from specdec.bench.runner import speculative_method

    target = load(tiny_pair["target"])
    decoder = SpeculativeDecoder(target, make_drafter("suffix", target=target), gamma=4, policy="fixed")
    method = speculative_method("suffix:fixed", decoder)
    accepted: list[int] = []

    def recorded(prompt_ids: list[int], settings: SamplingParams) -> MethodOutput:
        output = method.run(prompt_ids, settings)
        assert output.stats is not None
        accepted.append(output.stats.accepted)
        return output

    prompts = [Prompt("code", text) for text in ("7 3 9 2 8 1", "4 4 6 1 9 5")]
    run_side_by_side([Method("suffix:fixed", recorded, mark=method.mark)], prompts,
                     lambda text: [int(word) for word in text.split()], SamplingParams(max_new_tokens=24),
                     "suffix:fixed", warmup=False, repeats=3)
    assert accepted[:3] == [accepted[0]] * 3 and accepted[3:] == [accepted[3]] * 3, accepted


def test_the_long_suite_cuts_installed_files_near_each_length_with_three_asks():
    from specdec.bench.long_suite import CHARS_PER_TOKEN, LENGTHS, SOURCES, TASKS
    from specdec.bench.suite import suite_prompts

    prompts = suite_prompts("long")
    assert len(prompts) == len(LENGTHS) * len(SOURCES) * len(TASKS)
    for prompt in prompts:
        chars = LENGTHS[prompt.category] * CHARS_PER_TOKEN
        assert chars <= len(prompt.text) < chars * 1.5, prompt.id  # cut at the first def past the length
    by_id = {(p.category, p.id): p.text for p in prompts}
    continued = by_id["4k", "rich.console:continue"]
    signature = continued[continued.rindex("def ") :]  # the prompt ends with a whole signature
    assert signature.rstrip().endswith(":") and "\n\n" not in signature
    assert by_id["4k", "rich.console:add-method"].endswith("def ")
    assert by_id["4k", "rich.console:question"].endswith("# Answer:")
    assert [p.category for p in suite_prompts("long", per_category=1)] == list(LENGTHS)


def test_bench_reports_the_decode_and_prefill_rates_where_prompt_times_are_known(tiny_pair, prompt_file, tmp_path):
    """The long suite's question: how fast is generation once the prompt is in, and the prompt itself."""
    out = tmp_path / "bench"
    assert main(["bench", "--target", str(tiny_pair["target"]), "--prompts", str(prompt_file), "--methods",
                 "ngram:cost", "--max-new-tokens", "8", "--out", str(out), "--repeats", "1",
                 "--categories", "code"]) == 0
    payload = json.loads((out / "results.json").read_text())
    for summary in payload["summaries"]:
        assert summary["category"] in ("code", "all")
        seconds, prompt_seconds = summary["seconds"], summary["prompt_seconds"]
        assert 0 < prompt_seconds < seconds
        assert summary["decode_tokens_per_second"] == pytest.approx(summary["tokens"] / (seconds - prompt_seconds))
        assert summary["prefill_tokens_per_second"] == pytest.approx(summary["prompt_tokens"] / prompt_seconds)
    assert "decode tok/s" in (out / "results.md").read_text()


def test_a_step_is_split_into_draft_verify_and_rest_after_the_prompt():
    from specdec.bench.runner import Summary, markdown_table
    from specdec.core.metrics import SpecStats

    stats = SpecStats(draft_seconds=0.2, verify_seconds=1.0)
    for _ in range(10):
        stats.observe(3, 1)
    summary = Summary("auto", "specdec", "all", 1, 20, 1.5, stats, prompt_seconds=0.1)
    assert summary.step_milliseconds == pytest.approx({"draft": 20.0, "verify": 100.0, "rest": 20.0})
    assert summary.to_dict()["step_ms"] == summary.step_milliseconds
    table = markdown_table([summary, Summary("llama-target", "llama.cpp", "all", 1, 20, 1.0, None, prompt_seconds=0.1)])
    assert "| step ms: draft / verify / rest |" in table.splitlines()[0] + "|"
    assert "| 20.0 / 100.0 / 20.0 |" in table and "| llama-target |" in table
    assert Summary("auto", "specdec", "all", 1, 20, 1.5, stats).step_milliseconds is None  # the prompt's time unknown
