"""`specdec bench`: build the methods, run them side by side, write JSON, markdown and a chart."""

from __future__ import annotations

import datetime
import json
import platform
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from specdec.bench.runner import (
    DecodeSettings, Method, Prompt, markdown_table, run_side_by_side, speculative_method, summarize, write_json,
)
from specdec.engine import SpeculativeDecoder
from specdec.models.base import LanguageModel

REFERENCE = "target-only"


def load_prompts(path: Path, per_category: int | None = None) -> list[Prompt]:
    """A JSON list of {"category", "prompt", "id"?}; optionally the first N of each category."""
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    prompts, seen = [], {}
    for index, item in enumerate(json.loads(path.read_text())):
        category = item["category"]
        seen[category] = seen.get(category, 0) + 1
        if per_category is None or seen[category] <= per_category:
            prompts.append(Prompt(category, item["prompt"], item.get("id", str(index))))
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def all_speculative_methods() -> list[str]:
    from specdec.drafting import DRAFTERS
    from specdec.policy import POLICIES

    return [f"{drafter}:{policy}" for drafter in DRAFTERS for policy in POLICIES]


def make_method(name: str, target: LanguageModel, draft: LanguageModel | None, gamma: int,
                ngram_max: int = 4, ngram_min: int = 1) -> Method:
    """"target-only", or "DRAFTER:POLICY" (e.g. "model:fixed", "ngram:cost", "staged:threshold")."""
    from specdec.drafting import make_drafter

    if name == REFERENCE:
        return speculative_method(REFERENCE, SpeculativeDecoder(target))
    drafter_kind, _, policy = name.partition(":")
    drafter = make_drafter(drafter_kind, draft, max_n=ngram_max, min_n=ngram_min)
    return speculative_method(name, SpeculativeDecoder(target, drafter, gamma=gamma, policy=policy or "fixed"))


def build_methods(names: Sequence[str], target: LanguageModel, draft: LanguageModel | None, gamma: int,
                  ngram_max: int = 4, ngram_min: int = 1) -> list[Method]:
    return [make_method(name, target, draft, gamma, ngram_max, ngram_min) for name in expand_method_names(names)]


def expand_method_names(names: Sequence[str]) -> list[str]:
    """The reference first, then the rest; "all" expands to every drafter with every policy."""
    expanded = [m for name in names for m in (all_speculative_methods() if name == "all" else [name])]
    return list(dict.fromkeys([REFERENCE, *expanded]))


def machine_description() -> str:
    import os

    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, " \
           f"{torch.get_num_threads()} threads"


def run_bench(
    target: LanguageModel,
    draft: LanguageModel | None,
    methods: Sequence[str],
    prompts: Sequence[Prompt],
    settings: DecodeSettings,
    gamma: int,
    out: Path,
    progress: Callable[[str], None] | None = None,
    extra: dict | None = None,
    ngram_max: int = 4,
    ngram_min: int = 1,
) -> dict:
    built = build_methods(methods, target, draft, gamma, ngram_max, ngram_min)
    encode = lambda text: target.tokenizer.encode(text)  # noqa: E731
    measurements = run_side_by_side(built, prompts, encode, settings, REFERENCE, progress)
    baselines = [REFERENCE, *(["transformers-generate"] if any(m.name == "transformers-generate" for m in built) else [])]
    summaries = summarize(measurements, baselines)
    payload = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_description(),
        "target": target.name, "draft": draft.name if draft else None, "gamma": gamma,
        "settings": settings.__dict__,
        "greedy_identity_checked": settings.temperature == 0.0,
        "summaries": [s.to_dict() for s in summaries],
        "measurements": [
            {"method": m.method, "prompt": m.prompt.id, "category": m.prompt.category, "tokens": len(m.token_ids),
             "seconds": m.seconds, "alpha": m.stats.alpha if m.stats else None, "tau": m.stats.tau if m.stats else None}
            for m in measurements
        ],
        **(extra or {}),
    }
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", payload)
    categories = sorted({p.category for p in prompts})
    sections = [f"## all prompts\n\n{markdown_table(summaries)}"]
    if len(categories) > 1:
        sections += [f"## {c}\n\n{markdown_table(summaries, c)}" for c in categories]
    (out / "results.md").write_text(
        f"# specdec bench, {payload['date']}\n\nmachine: {payload['machine']}; target {target.name}, "
        f"draft {payload['draft']}, gamma {gamma}, temperature {settings.temperature}, "
        f"max_new_tokens {settings.max_new_tokens}, {len(prompts)} prompts\n\n" + "\n\n".join(sections) + "\n"
    )
    payload["markdown"] = (out / "results.md").read_text()
    payload["summary_objects"] = summaries
    return payload
