"""Side-by-side measurement of decoding methods on the same models and prompts.

Methods run interleaved (for every prompt, every method, in a rotating order) so that all of
them share the machine's noise, and every greedy output is checked against the reference
method's output in the same run.
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specdec.bench.code_task import CodeTask
from specdec.constraint import Constraint
from specdec.core.drafts import suffix_caches
from specdec.core.metrics import SpecStats
from specdec.core.sampling import SamplingParams

REFERENCE = "target-only"  # the target alone: every run has it, speedups are against it


@dataclass(frozen=True)
class Prompt:
    category: str
    text: str
    id: str = ""
    constraint: Constraint | None = None  # what the output must match (a suite's "json_schema" / "regex")
    stop: tuple[str, ...] = ()  # stop strings of this prompt's suite, beside the run's own
    task: CodeTask | None = None  # a program whose tests the output must pass (HumanEval)
    prediction: str | None = None  # the output the client expects (OpenAI's predicted outputs), drafted from

    def settings(self, settings: SamplingParams) -> SamplingParams:
        """The run's settings with this prompt's constraint, stop strings and prediction."""
        changes: dict = {}
        if self.prediction is not None:
            changes["prediction"] = self.prediction
        if self.constraint is not None:
            changes["constraint"] = self.constraint
        if self.stop:
            changes["stop"] = tuple(dict.fromkeys((*settings.stop, *self.stop)))
        return dataclasses.replace(settings, **changes) if changes else settings


@dataclass
class MethodOutput:
    token_ids: list[int]
    seconds: float  # prompt and generation
    stats: SpecStats | None = None  # None for methods that report no speculation stats
    prompt_seconds: float | None = None  # the prompt's part of seconds (prefill, prompt eval), where known


@dataclass(frozen=True)
class Method:
    """A named way to decode: prompt ids + settings -> generated ids (and stats when it has them)."""

    name: str
    run: Callable[[list[int], SamplingParams], MethodOutput]
    engine: str = "specdec"  # whose loop it is: "specdec" or "transformers"
    lossless: bool = True  # a greedy output different from the reference is a failure
    # Marks what the method keeps across requests (a suffix cache's outputs) and returns the call
    # that forgets what was added since: a repeat must not copy its own earlier run's output.
    mark: Callable[[], Callable[[], None]] | None = None
    acceptance: str | None = None  # its own (a name's @ACCEPTANCE, specdec.core.acceptance); None: the run's

    def settings(self, settings: SamplingParams) -> SamplingParams:
        """The run's settings as this method decodes with them."""
        return settings if self.acceptance is None else dataclasses.replace(settings, acceptance=self.acceptance)

    def lossy(self, settings: SamplingParams) -> bool:
        """Whether it decodes with a LOSSY acceptance in a run with these settings (specdec's own methods:
        the other engines' ignore --acceptance)."""
        return self.engine == "specdec" and self.settings(settings).lossy


@dataclass
class Measurement:
    method: str
    engine: str
    prompt: Prompt
    token_ids: list[int]
    seconds: float
    stats: SpecStats | None
    peak_memory_mb: float | None = None
    timings: list[float] = field(default_factory=list)  # every repeat's seconds; seconds is their median
    passed: bool | None = None  # the output passed its prompt's tests (None: the prompt has none)
    check_outcome: str | None = None  # what running them gave: "passed", "timed out", "failed: ..."
    # A LOSSY method where identity would be checked: whether it was compared with the reference, and
    # its first generated token that differs (None: the same tokens); drift, not a failure
    drift_checked: bool = False
    first_difference: int | None = None
    prompt_seconds: float | None = None  # the prompt's part of seconds (the median repeat's), where known
    prompt_tokens: int = 0

    @property
    def stalled(self) -> bool:
        """A repeat took over twice the median: the machine was busy with something else."""
        return len(self.timings) > 1 and max(self.timings) > STALL_RATIO * self.seconds


STALL_RATIO = 2.0
WARMUP_TOKENS = 256


class IdentityError(AssertionError):
    """A lossless method's greedy output differs from the reference's."""


@dataclass(frozen=True)
class Mismatch:
    """Where a lossless method's greedy output left its engine's reference output."""

    method: str
    reference: str
    prompt: str
    category: str
    position: int  # the first generated token that differs
    margin: float | None = None  # the target's top-1 minus top-2 logit there (small: a near tie)

    def __str__(self) -> str:
        margin = "" if self.margin is None else f" (target's top-2 logit margin there: {self.margin:.4g})"
        return (f"{self.method} on prompt {self.prompt} ({self.category}): differs from {self.reference} at "
                f"generated token {self.position}{margin}")


@dataclass
class SideBySide:
    measurements: list[Measurement] = field(default_factory=list)
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def failed_methods(self) -> list[str]:
        return list(dict.fromkeys(m.method for m in self.mismatches))

    def raise_on_mismatch(self) -> None:
        if self.mismatches:
            raise IdentityError("outputs differ from the reference:\n" + "\n".join(map(str, self.mismatches)))


def output_matches(constraint: Constraint, text: str) -> bool | None:
    """Whether a constrained output is what was asked: JSON that parses (and validates against
    its schema where the jsonschema package is installed), or a full regex match. None: not
    checkable here (a grammar)."""
    if constraint.kind == "regex":
        return re.fullmatch(constraint.source, text) is not None
    if constraint.kind == "grammar":
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    if constraint.kind == "json_object":
        return isinstance(value, dict)
    try:
        import jsonschema
    except ImportError:
        return True
    return jsonschema.Draft202012Validator(json.loads(constraint.source)).is_valid(value)


KEEP = "keep"  # speculative_method's prediction: the prompt's own


def speculative_method(name: str, decoder, engine: str = "specdec", acceptance: str | None = None,
                       prediction: str | None = KEEP) -> Method:
    """A specdec SpeculativeDecoder as a benchmark method (``acceptance``: its own, else the run's;
    ``prediction``: the prompt's own (KEEP), none, or this text in its place)."""

    def run(prompt_ids: list[int], settings: SamplingParams) -> MethodOutput:
        if acceptance is not None:
            settings = dataclasses.replace(settings, acceptance=acceptance)
        if prediction != KEEP:
            settings = dataclasses.replace(settings, prediction=prediction)
        started = time.perf_counter()
        result = decoder.generate(prompt_ids, sampling=settings)
        return MethodOutput(result.token_ids, time.perf_counter() - started, result.stats, result.stats.prefill_seconds)

    def mark() -> Callable[[], None]:
        marks = [(cache, cache.next_sequence) for cache in suffix_caches(decoder.engine.drafter)]

        def forget() -> None:
            for cache, at in marks:
                cache.forget_since(at)

        return forget

    return Method(name, run, engine, mark=mark, acceptance=acceptance)


def peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def first_difference(got: Sequence[int], expected: Sequence[int]) -> int | None:
    if list(got) == list(expected):
        return None
    return next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b),
                min(len(got), len(expected)))


def run_side_by_side(
    methods: Sequence[Method],
    prompts: Sequence[Prompt],
    encode: Callable[[str], list[int]],
    settings: SamplingParams,
    reference: str,
    progress: Callable[[str], None] | None = None,
    warmup: bool = True,
    references: dict[str, str] | None = None,
    margin: Callable[[list[int], list[int]], float] | None = None,
    on_prompt: Callable[[SideBySide], None] | None = None,
    repeats: int = 1,
) -> SideBySide:
    """Every method on every prompt, in a rotating order. Greedy outputs of lossless methods are
    checked against their own engine's reference method (``references``: engine -> method name;
    by default ``reference`` for its engine): a mismatch is recorded with the target's logit
    margin at the divergence (``margin(prompt_ids, reference_ids_before_it)``) and the run goes
    on. ``on_prompt`` sees the results so far after every prompt (to write them as they come).
    Each method runs ``repeats`` times per prompt (one after another); its time is the median,
    and its output and stats are the first run's."""
    names = {m.name: m for m in methods}
    if reference not in names:
        raise ValueError(f"the reference method {reference!r} is not among {list(names)}")
    references = references or {names[reference].engine: reference}
    if warmup:  # first calls pay one-off costs (allocations, lazy imports) that are not decoding
        short = dataclasses.replace(prompts[0].settings(settings), max_new_tokens=4)
        for method in methods:  # at most WARMUP_TOKENS of the prompt: a long suite's would cost minutes
            method.run(encode(prompts[0].text)[:WARMUP_TOKENS], short)
    run = SideBySide()
    for index, prompt in enumerate(prompts):
        prompt_ids = encode(prompt.text)
        rotation = index % len(methods)
        outputs: dict[str, MethodOutput] = {}
        measured: dict[str, Measurement] = {}
        prompt_settings = prompt.settings(settings)
        for method in [*methods[rotation:], *methods[:rotation]]:
            runs = []
            for repeat in range(repeats):  # every repeat finds the cross-request caches as the first did
                forget = method.mark() if method.mark is not None and repeat < repeats - 1 else None
                runs.append(method.run(prompt_ids, prompt_settings))
                if forget is not None:
                    forget()
            output, timings = runs[0], [run_output.seconds for run_output in runs]
            outputs[method.name] = output
            median_run = sorted(runs, key=lambda run_output: run_output.seconds)[(len(runs) - 1) // 2]
            measured[method.name] = Measurement(method.name, method.engine, prompt, output.token_ids,
                                                statistics.median(timings), output.stats, peak_rss_mb(), timings,
                                                prompt_seconds=median_run.prompt_seconds,
                                                prompt_tokens=len(prompt_ids))
            run.measurements.append(measured[method.name])
            if progress:
                progress(f"{prompt.category}/{prompt.id or index}: {method.name}")
        for method in methods:
            own_reference = references.get(method.engine)
            if not identity_checked(settings, method.engine) or not method.lossless or own_reference not in outputs:
                continue
            expected = outputs[own_reference].token_ids
            position = first_difference(outputs[method.name].token_ids, expected)
            if method.lossy(settings):  # where the LOSSY output left the exact one: drift, recorded
                measured[method.name].drift_checked, measured[method.name].first_difference = True, position
            elif position is not None:
                gap = margin(prompt_ids, expected[:position]) if margin is not None else None
                run.mismatches.append(Mismatch(method.name, own_reference, prompt.id or str(index), prompt.category,
                                               position, gap))
        if on_prompt is not None:
            on_prompt(run)
    return run


def identity_checked(settings: SamplingParams, engine: str) -> bool:
    """Whether an engine's methods must give its reference's very tokens: greedy, or sampled by
    specdec's coupled rule (a seed gives the target alone's text, whatever drafts it)."""
    return settings.greedy or (engine == "specdec" and settings.rule == "coupled")


@dataclass
class Summary:
    method: str
    engine: str
    category: str
    prompts: int
    tokens: int
    seconds: float
    stats: SpecStats | None
    speedups: dict[str, float] = field(default_factory=dict)  # over each baseline method
    peak_memory_mb: float | None = None
    passed: int = 0  # outputs that passed their tests, of ``checked`` prompts that have tests
    checked: int = 0
    prompt_tokens: int = 0
    prompt_seconds: float | None = None  # of seconds, the prompts' part (None: not known for every prompt)

    @property
    def prefill_tokens_per_second(self) -> float | None:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else None

    @property
    def decode_tokens_per_second(self) -> float | None:
        """Generated tokens a second after the prompt is in (the prompt's time left out)."""
        if self.prompt_seconds is None or self.seconds <= self.prompt_seconds:
            return None
        return self.tokens / (self.seconds - self.prompt_seconds)

    @property
    def step_milliseconds(self) -> dict[str, float] | None:
        """A verify step's mean time after the prompt, split: the drafter's proposing, the verify
        (the target's forward and the accept / reject), and the rest (the engine's bookkeeping, the
        sampler, the stop checks). None where the steps or the prompt's time are not known."""
        stats = self.stats
        if stats is None or not stats.target_forwards or self.prompt_seconds is None:
            return None
        rest = max(0.0, self.seconds - self.prompt_seconds - stats.draft_seconds - stats.verify_seconds)
        return {name: 1e3 * seconds / stats.target_forwards for name, seconds in
                (("draft", stats.draft_seconds), ("verify", stats.verify_seconds), ("rest", rest))}

    @property
    def pass_at_1(self) -> float | None:
        return self.passed / self.checked if self.checked else None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict:
        stats = self.stats
        return {
            "method": self.method, "engine": self.engine, "category": self.category, "prompts": self.prompts,
            "tokens": self.tokens, "seconds": self.seconds, "tokens_per_second": self.tokens_per_second,
            "prompt_tokens": self.prompt_tokens, "prompt_seconds": self.prompt_seconds,
            "prefill_tokens_per_second": self.prefill_tokens_per_second,
            "decode_tokens_per_second": self.decode_tokens_per_second,
            "speedup": self.speedups, "peak_memory_mb": self.peak_memory_mb, "step_ms": self.step_milliseconds,
            "alpha": stats.alpha if stats and stats.drafted else None,
            "tau": stats.tau if stats and stats.target_forwards else None,
            "acceptance_by_position": stats.acceptance_by_position if stats else None,
            **({"pass_at_1": self.pass_at_1, "passed": self.passed, "checked": self.checked} if self.checked else {}),
            **({"acceptance": stats.acceptance, "relaxed_accepted": stats.relaxed_accepted}
               if stats and stats.acceptance != "exact" else {}),
        }


def summarize(measurements: Sequence[Measurement], baselines: Sequence[str]) -> list[Summary]:
    """Per method, per category and overall ("all"): tokens/s over the summed time, merged stats,
    and speedup over each baseline (ratio of tokens/s on the same prompts)."""
    categories = sorted({m.prompt.category for m in measurements})
    methods = list(dict.fromkeys(m.method for m in measurements))
    summaries: list[Summary] = []
    for category in [*categories, "all"]:
        selected = [m for m in measurements if category in ("all", m.prompt.category)]
        by_method: dict[str, Summary] = {}
        for name in methods:
            rows = [m for m in selected if m.method == name]
            stats = None
            for row in rows:
                if row.stats is not None:
                    stats = row.stats if stats is None else stats.merge(row.stats)
            known = [r.prompt_seconds for r in rows if r.prompt_seconds is not None]
            by_method[name] = Summary(
                name, rows[0].engine, category, len(rows), sum(len(r.token_ids) for r in rows),
                sum(r.seconds for r in rows), stats, peak_memory_mb=max((r.peak_memory_mb or 0) for r in rows),
                passed=sum(bool(r.passed) for r in rows), checked=sum(r.passed is not None for r in rows),
                prompt_tokens=sum(r.prompt_tokens for r in rows),
                prompt_seconds=sum(known) if len(known) == len(rows) else None,
            )
        for summary in by_method.values():
            for baseline in baselines:
                if baseline in by_method and by_method[baseline].tokens_per_second:
                    summary.speedups[baseline] = summary.tokens_per_second / by_method[baseline].tokens_per_second
        summaries.extend(by_method.values())
    return summaries


def markdown_table(summaries: Sequence[Summary], category: str = "all") -> str:
    rows = [s for s in summaries if s.category == category]
    baselines = list(dict.fromkeys(b for s in rows for b in s.speedups))
    checked = any(s.checked for s in rows)  # a suite with tests: pass@1 beside the speed
    # Where every method's prompt time is known: the prompt's and the generation's rates apart too.
    phases = all(s.decode_tokens_per_second is not None for s in rows)
    steps = any(s.step_milliseconds is not None for s in rows)
    header = ["method", "tokens/s", *(["decode tok/s", "prefill tok/s"] if phases else []),
              *[f"speedup vs {b}" for b in baselines], *(["pass@1"] if checked else []),
              "alpha", "tau", *(["step ms: draft / verify / rest"] if steps else []), "acceptance by position"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for s in rows:
        d = s.to_dict()
        cells = [
            s.method,
            f"{s.tokens_per_second:.1f}",
            *([f"{s.decode_tokens_per_second:.1f}", f"{s.prefill_tokens_per_second or 0:.1f}"] if phases else []),
            *[f"{s.speedups.get(b, float('nan')):.2f}x" for b in baselines],
            *([f"{s.passed}/{s.checked} ({s.pass_at_1:.3f})" if s.checked else "-"] if checked else []),
            f"{d['alpha']:.3f}" if d["alpha"] is not None else "-",
            f"{d['tau']:.2f}" if d["tau"] is not None else "-",
            *([" / ".join(f"{ms:.1f}" for ms in d["step_ms"].values()) if d["step_ms"] else "-"] if steps else []),
            " ".join(f"{a:.2f}" for a in d["acceptance_by_position"] or []) or "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
