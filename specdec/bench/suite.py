"""`specdec bench`: build the methods, run them side by side, write JSON, markdown and a chart."""

from __future__ import annotations

import dataclasses
import datetime
import json
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from specdec.bench.humaneval import pass_at_1_disagreements, score_measurements
from specdec.bench.llama_cpp_tools import LLAMA_CPP_REFERENCE, LlamaCppTools, is_llama_cpp_method, llama_cpp_method
from specdec.bench.plot import plot_speed_against_pass_at_1, plot_summaries
from specdec.bench.runner import (
    REFERENCE,
    Method,
    MethodOutput,
    Prompt,
    SideBySide,
    identity_checked,
    markdown_table,
    output_matches,
    run_side_by_side,
    speculative_method,
    summarize,
    write_json,
)
from specdec.config import SpeculationConfig
from specdec.constraint import Constraint
from specdec.core.sampling import SamplingParams
from specdec.decoder import SpeculativeDecoder
from specdec.drafting.datastore import Datastore
from specdec.drafting.vocab import vocabulary_mismatch
from specdec.models.base import LanguageModel
from specdec.names import NO_INDEX_FLAG, NO_PREDICTION_FLAG, UNRELATED_PREDICTION_FLAG


def load_prompts(path: Path, per_category: int | None = None) -> list[Prompt]:
    """A JSON list of {"category", "prompt", "id"?, "json_schema"? | "regex"?} (the last two: what
    the output must match); optionally the first N of each category."""
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    prompts: list[Prompt] = []
    for index, item in enumerate(json.loads(path.read_text())):
        constraint = (Constraint.json_schema(item["json_schema"]) if "json_schema" in item
                      else Constraint.regex(item["regex"]) if "regex" in item else None)
        prompts.append(Prompt(item["category"], item["prompt"], item.get("id", str(index)), constraint))
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return first_of_each_category(prompts, per_category)


def first_of_each_category(prompts: list[Prompt], per_category: int | None) -> list[Prompt]:
    """The first ``per_category`` prompts of each category (None: all), in their order."""
    seen: dict[str, int] = {}  # prompts kept per category
    kept = []
    for prompt in prompts:
        seen[prompt.category] = seen.get(prompt.category, 0) + 1
        if per_category is None or seen[prompt.category] <= per_category:
            kept.append(prompt)
    return kept


def suite_prompts(name: str, per_category: int | None = None) -> list[Prompt]:
    """A suite by name (names.BENCH_SUITES): a bundled prompt file (specdec.defaults) or HumanEval
    (specdec.bench.humaneval); optionally the first N prompts of each category."""
    from specdec.defaults import default_prompts, editing_prompts, json_prompts
    from specdec.names import BENCH_SUITES

    if name == "humaneval":
        from specdec.bench.humaneval import humaneval_suite

        return humaneval_suite()[:per_category]  # one category: its first N problems
    if name == "long":
        from specdec.bench.long_suite import long_suite

        return first_of_each_category(long_suite(), per_category)
    if name == "predicted-edits":
        from specdec.bench.predicted_edits import predicted_edits_suite

        return first_of_each_category(predicted_edits_suite(), per_category)
    files = {"bundled": default_prompts, "editing": editing_prompts, "json": json_prompts}
    if name not in files:
        raise ValueError(f"unknown suite {name!r}; choose one of {', '.join(BENCH_SUITES)}")
    return load_prompts(files[name](), per_category)


TRANSFORMERS_METHODS = ("transformers-generate", "transformers-assisted", "transformers-prompt-lookup")


def transformers_options(name: str) -> dict:
    """generate() options for a transformers method name:
    transformers-generate                     plain greedy / sampling
    transformers-assisted                     assisted generation, the library's defaults (transformers
                                              5: 20 draft tokens, constant schedule, drafting stops early
                                              when the draft's confidence falls below 0.4)
    transformers-assisted:N                   N draft tokens every step, no confidence stop (like our fixed)
    transformers-assisted:heuristic           the "heuristic" schedule: +2 after a fully accepted step, else -1
    transformers-prompt-lookup[:N]            prompt lookup with N tokens (default 10, as its docs suggest)
    Assistant options live on the assistant's generation_config, where transformers reads them."""
    base, _, setting = name.partition(":")
    if base not in TRANSFORMERS_METHODS or (setting and base == "transformers-generate"):
        raise ValueError(f"unknown transformers method {name!r}")
    if base == "transformers-prompt-lookup":
        if setting and not setting.isdigit():
            raise ValueError(f"{name!r}: the setting is a number of tokens, as in transformers-prompt-lookup:5")
        return {"prompt_lookup_num_tokens": int(setting or 10)}
    if base == "transformers-generate":
        return {}
    if setting == "heuristic":
        return {"assistant": {"num_assistant_tokens_schedule": "heuristic"}}
    if setting:
        if not setting.isdigit() or int(setting) < 1:
            raise ValueError(f"{name!r}: the setting is a positive number of draft tokens or 'heuristic'")
        return {"assistant": {"num_assistant_tokens": int(setting), "num_assistant_tokens_schedule": "constant",
                              "assistant_confidence_threshold": 0.0}}
    return {"assistant": {}}


def is_transformers_method(name: str) -> bool:
    return name.partition(":")[0] in TRANSFORMERS_METHODS


def transformers_method(name: str, target: LanguageModel, draft: LanguageModel | None) -> Method:
    """transformers' own generate() on the same checkpoints (see transformers_options)."""
    from transformers import AutoModelForCausalLM

    def load_hf(model: LanguageModel) -> Any:  # a transformers PreTrainedModel
        if model.path is None:
            raise ValueError(f"{name} needs a model loaded from a folder")
        loaded: Any = AutoModelForCausalLM.from_pretrained(model.path, dtype=model.dtype)
        return loaded.to(model.device).eval()

    hf_target = load_hf(target)
    extra = transformers_options(name)
    if "assistant" in extra:
        if draft is None:
            raise ValueError(f"{name} needs a draft model (--draft)")
        assistant = load_hf(draft)
        for key, value in extra.pop("assistant").items():
            setattr(assistant.generation_config, key, value)
        extra["assistant_model"] = assistant
        if vocabulary_mismatch(draft, target) is not None:  # universal assisted decoding translates
            extra.update(tokenizer=target.tokenizer, assistant_tokenizer=draft.tokenizer)
    tokenizer = target.tokenizer

    def run(prompt_ids: list[int], settings: SamplingParams) -> MethodOutput:
        sampling = {"do_sample": False} if settings.temperature == 0.0 else {
            "do_sample": True, "temperature": settings.temperature, "top_k": settings.top_k or None,
            "top_p": settings.top_p, "min_p": settings.min_p or None}
        torch.manual_seed(settings.seed or 0)
        started = time.perf_counter()
        input_ids = torch.tensor([prompt_ids], device=target.device)
        with torch.inference_mode():
            output = hf_target.generate(
                # an explicit mask: otherwise prompt tokens equal to the pad id would be masked out
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=settings.max_new_tokens,
                eos_token_id=list(target.eos_token_ids) or None, pad_token_id=tokenizer.pad_token_id
                if tokenizer is not None else None, **sampling, **extra)
        seconds = time.perf_counter() - started
        return MethodOutput(output[0, len(prompt_ids):].tolist(), seconds)

    return Method(name, run, engine="transformers")


def all_speculative_methods() -> list[str]:
    from specdec.core.policy import POLICIES
    from specdec.drafting import DRAFTERS

    # Heads need a trained head (--draft-head), corpus drafters a datastore (--index): name them explicitly.
    # auto chooses its own lengths.
    return ["auto", *(f"{drafter}:{policy}" for drafter in DRAFTERS if not drafter.startswith(("head", "corpus")) and
                      drafter != "auto" for policy in POLICIES if policy != "auto")]


def make_method(name: str, target: LanguageModel, draft: LanguageModel | None, gamma: int | None,
                ngram_max: int = 4, ngram_min: int = 1, llama_tools: LlamaCppTools | None = None,
                head=None, corpus: Sequence[Datastore] = ()) -> Method:
    """"target-only", "DRAFTER:POLICY" (e.g. "model:fixed", "ngram:cost", "staged:threshold"), a
    transformers method (transformers_options) or a llama.cpp tool (specdec.bench.llama_cpp_tools).
    specdec's own methods take flags: "@unforced", "@ACCEPTANCE" ("auto@lossy", "suffix:cost@topk:k=3"),
    "@head=DIR" (the head in DIR in place of ``head``: "auto auto@head=OLD" sets two heads side by side),
    "@noindex" (auto without the datastores in ``corpus``: "auto@noindex"), and for a suite with
    predictions "@noprediction" (without the prompt's) and "@unrelated" (an unrelated file's text in
    its place: what a wrong prediction costs)."""

    if is_llama_cpp_method(name):
        if llama_tools is None:
            raise ValueError(f"{name} needs --llama-cpp-bin DIR and --target-gguf FILE")
        return llama_cpp_method(name, llama_tools, target.tokenizer)
    if name == REFERENCE:  # the reference is the target alone, exact under any --acceptance (nothing to relax)
        return speculative_method(REFERENCE, SpeculativeDecoder(target), acceptance="exact")
    if is_transformers_method(name):
        return transformers_method(name, target, draft)
    config, flags = SpeculationConfig.from_method(name)
    corpus = () if NO_INDEX_FLAG in flags else corpus
    prediction = next((flag for flag in flags if flag in (NO_PREDICTION_FLAG, UNRELATED_PREDICTION_FLAG)), None)
    acceptance = config.acceptance if "acceptance" in config.options_given else None  # else the run's
    if config.drafts:  # (the run's settings, for every method alike: not options this method was given)
        config = dataclasses.replace(config, gamma=gamma, ngram_max=ngram_max, ngram_min=ngram_min)
    if config.draft_head is not None:  # "@head=DIR": this method's own head, loaded from its folder
        head = None
    decoder = SpeculativeDecoder.from_config(target, config, draft, head, corpus)
    if prediction is None:
        return speculative_method(name, decoder, acceptance=acceptance)
    return speculative_method(name, decoder, acceptance=acceptance,
                              prediction=None if prediction == NO_PREDICTION_FLAG else unrelated_file())



def unrelated_file() -> str:
    """A prediction that has nothing to do with any suite's prompt: the standard library's JSON
    decoder, whatever the prompt's file is."""
    import inspect
    import json.decoder

    return inspect.getsource(json.decoder)


def needs_draft_model(names: Sequence[str]) -> bool:
    """Whether any of these methods drafts with a draft model (auto takes one only when named)."""
    from specdec.names import TEXT_DRAFTERS, base_kinds

    for name in expand_method_names(names):
        method = name.partition("@")[0]
        if is_llama_cpp_method(method) or method == REFERENCE:
            continue
        if is_transformers_method(method):
            if method.startswith("transformers-assisted"):
                return True
            continue
        free = (*TEXT_DRAFTERS, "auto", "head", "head-tree")  # drafters that need no draft model
        if any(kind not in free for kind in base_kinds(method.partition(":")[0])):
            return True
    return False


def build_methods(names: Sequence[str], target: LanguageModel, draft: LanguageModel | None, gamma: int | None,
                  ngram_max: int = 4, ngram_min: int = 1, llama_tools: LlamaCppTools | None = None,
                  head=None, corpus: Sequence[Datastore] = ()) -> list[Method]:
    """head: a DraftHead or an EAGLE-3 folder for the head methods (loaded once, shared); corpus: the
    datastores of the corpus drafters and auto (read-only, shared)."""
    from specdec.drafting import DraftHead, load_head
    from specdec.drafting.head_format import head_quantization

    names = expand_method_names(names)
    if llama_tools is not None:
        llama_tools.check([name for name in names if is_llama_cpp_method(name)])
    if head is not None and not isinstance(head, DraftHead):
        head = load_head(head, target, quantize=head_quantization(target))
    return [make_method(name, target, draft, gamma, ngram_max, ngram_min, llama_tools, head, corpus)
            for name in names]


def expand_method_names(names: Sequence[str]) -> list[str]:
    """The reference first, then the rest; "all" expands to every drafter with every policy."""
    expanded = [m for name in names for m in (all_speculative_methods() if name == "all" else [name])]
    return list(dict.fromkeys([REFERENCE, *expanded]))


def machine_description() -> str:
    import os

    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, " \
           f"{torch.get_num_threads()} threads"


def check_constrained_methods(methods: Sequence[str], prompts: Sequence[Prompt]) -> None:
    """ValueError if a suite with JSON schemas or regexes meets methods that cannot follow them."""
    others = [m for m in expand_method_names(methods) if is_llama_cpp_method(m) or is_transformers_method(m)]
    if others and any(prompt.constraint is not None for prompt in prompts):
        raise ValueError(f"{', '.join(others)} cannot follow the prompts' JSON schemas or regexes "
                         "(only specdec's own methods do); leave them out for this suite")


def run_bench(
    target: LanguageModel,
    draft: LanguageModel | None,
    methods: Sequence[str],
    prompts: Sequence[Prompt],
    settings: SamplingParams,
    gamma: int | None,
    out: Path,
    progress: Callable[[str], None] | None = None,
    extra: dict | None = None,
    ngram_max: int = 4,
    ngram_min: int = 1,
    repeats: int = 1,
    llama_tools: LlamaCppTools | None = None,
    head=None,
    corpus: Sequence[Datastore] = (),
) -> dict:
    check_constrained_methods(methods, prompts)
    built = build_methods(methods, target, draft, gamma, ngram_max, ngram_min, llama_tools, head, corpus)
    encode = lambda text: target.tokenizer.encode(text)  # noqa: E731
    names = {m.name for m in built}
    # Each engine's methods are checked against that engine's own target-only decoding: other
    # kernels (and another int8 scheme) may break near-ties differently, which is not a bug.
    engine_references = {"transformers": "transformers-generate", "llama.cpp": LLAMA_CPP_REFERENCE}
    references = {"specdec": REFERENCE, **{engine: name for engine, name in engine_references.items() if name in names}}
    header = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_description(),
        "target": target.name, "draft": draft.name if draft else None, "gamma": gamma,
        "settings": dataclasses.asdict(settings),
        "greedy_identity_checked": settings.temperature == 0.0 and not settings.lossy,
        # sampled with the coupled rule: specdec's methods must give the target alone's tokens too
        "coupled_identity_checked": not settings.greedy and settings.rule == "coupled" and not settings.lossy,
        "identity_references": references,
        **(extra or {}),
    }

    def results(run: SideBySide, complete: bool) -> dict:
        return {**header, "complete": complete, "repeats": repeats, "failed_methods": run.failed_methods,
                "stalled": [f"{m.method} on {m.prompt.id}" for m in run.measurements if m.stalled],
                "mismatches": [dataclasses.asdict(m) for m in run.mismatches],
                "measurements": [
                    {"method": m.method, "prompt": m.prompt.id, "category": m.prompt.category,
                     "tokens": len(m.token_ids), "seconds": m.seconds, "alpha": m.stats.alpha if m.stats else None,
                     "tau": m.stats.tau if m.stats else None, "timings": m.timings,
                     # LOSSY acceptance: marked, with the drafts only it kept and where the text left the exact one
                     **({"acceptance": m.stats.acceptance, "relaxed_accepted": m.stats.relaxed_accepted}
                        if m.stats and m.stats.acceptance != "exact" else {}),
                     **({"identical_to_reference": m.first_difference is None, "first_difference": m.first_difference}
                        if m.drift_checked else {}),
                     # acceptance per draft depth, and where the time went (a draft's cost per token)
                     **({"drafted_at": m.stats.drafted_at, "accepted_at": m.stats.accepted_at,
                         "draft_seconds": m.stats.draft_seconds, "verify_seconds": m.stats.verify_seconds,
                         "target_forwards": m.stats.target_forwards} if m.stats else {}),
                     # auto's choices, candidate -> [steps, drafted, accepted] (the corpus's accepted tokens)
                     **({"by_drafter": m.stats.by_drafter} if m.stats and m.stats.by_drafter else {}),
                     # a draft with another tokenizer: its own tokens drafted, and those translated
                     **({"source_drafted": m.stats.source_drafted, "source_kept": m.stats.source_kept}
                        if m.stats and m.stats.source_drafted else {}),
                     # a constrained prompt: whether the output is what was asked, and the forced tokens
                     **({"valid": output_matches(m.prompt.constraint, target.tokenizer.decode(
                         m.token_ids, skip_special_tokens=True)), "forced_tokens": m.stats.forced_tokens if m.stats
                         else None, "grammar_seconds": m.stats.grammar_seconds if m.stats else None}
                        if m.prompt.constraint is not None else {}),
                     **({"passed": m.passed, "check": m.check_outcome} if m.passed is not None else {})}
                    for m in run.measurements]}

    out.mkdir(parents=True, exist_ok=True)
    run = run_side_by_side(built, prompts, encode, settings, REFERENCE, progress, references=references,
                           margin=lambda prompt_ids, before: top2_margin(target, prompt_ids + before),
                           on_prompt=lambda so_far: write_json(out / "results.json", results(so_far, False)),
                           repeats=repeats)
    measurements = run.measurements
    if any(prompt.task is not None for prompt in prompts):  # after every timing, not between them
        score_measurements(measurements, lambda ids: target.tokenizer.decode(ids, skip_special_tokens=True),
                           out / "humaneval_samples.jsonl")
    baselines = [REFERENCE, *[name for engine, name in references.items() if engine != "specdec"]]
    summaries = summarize(measurements, baselines)
    exact = {m.name: m.engine for m in built  # lossy methods' pass@1 is their drift, not a disagreement
             if m.lossless and not m.lossy(settings) and identity_checked(settings, m.engine)}
    payload = {**results(run, True), "summaries": [s.to_dict() for s in summaries],
               "pass_at_1_disagreements": pass_at_1_disagreements(summaries, exact)}
    write_json(out / "results.json", payload)
    categories = sorted({p.category for p in prompts})
    sections = [f"## all prompts\n\n{markdown_table(summaries)}"]
    if len(categories) > 1:
        sections += [f"## {c}\n\n{markdown_table(summaries, c)}" for c in categories]
    checked = [m for m in payload["measurements"] if m.get("valid") is not None]
    if checked:
        valid = sum(m["valid"] for m in checked)
        sections.append(f"constrained outputs that match their schema or regex: {valid} of {len(checked)}")
    sections += [f"**{line}** (see the identity failures)" for line in payload["pass_at_1_disagreements"]]
    if run.mismatches:
        sections.insert(0, "## greedy identity failures\n\n" + "\n".join(f"- {m}" for m in run.mismatches))
    (out / "results.md").write_text(
        f"# specdec bench, {payload['date']}\n\nmachine: {payload['machine']}; target {target.name}, "
        f"draft {payload['draft']}, gamma {gamma or 'default'}, temperature {settings.temperature}, "
        f"{f'LOSSY acceptance {settings.acceptance}, ' if settings.lossy else ''}"
        f"max_new_tokens {settings.max_new_tokens}, {len(prompts)} prompts"
        + "".join(f", {key} {header[key]!r}" for key in ("suite", "instruction") if header.get(key)) + "\n\n"
        + "\n\n".join(sections) + "\n"
    )
    subtitle = f"{target.name} / {payload['draft']}, temperature {settings.temperature}, {payload['date'][:10]}"
    plot_summaries(summaries, out / "results.png", subtitle)
    plot_speed_against_pass_at_1(summaries, out / "pass_at_1.png", subtitle)
    payload["markdown"] = (out / "results.md").read_text()
    payload["summary_objects"] = summaries
    return payload


def top2_margin(target: LanguageModel, context: list[int]) -> float:
    """The target's top-1 minus top-2 logit after ``context`` (a near tie when small)."""
    logits = target.extend(torch.tensor(context, device=target.device), target.new_cache())[-1]
    best = logits.float().topk(2).values
    return float(best[0] - best[1])
