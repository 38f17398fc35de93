"""`specdec bench-serve`: a server's throughput and latency against concurrency, with speculation
on, off and auto, through HTTP as clients see it.

One server per mode runs at once on the same loaded models (idle servers use no CPU). For every
concurrency C, for every mode in turn (interleaved, so drift hits every mode alike): C clients
send --requests streaming requests between them, each client one after another (a closed loop). Recorded:
generated tokens per second over the wall time, time to first token and time per output token
after it (medians over requests), the draft length the server chose (auto) and the acceptance.
Greedy texts are compared across modes per prompt: lossless speculation must not change them.

``--workload replay`` sends conversations instead of single requests: each turn's prompt is the
previous prompt, its answer and a follow-up asking for the code again (an agent loop resending
earlier answers), over the editing suite; every round replays the same traffic. With
``--compare-cache`` each speculating mode also runs with its suffix cache off, so the cache's worth
is measured side by side; caches are emptied before each concurrency, so a measurement's first
round starts cold and later rounds find the earlier rounds' answers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

FOLLOW_UP = "\n\n# Once more, the whole code above, unchanged:\n"


async def closed_loop(url: str, model: str, prompts: list[str], clients: int, per_client: int, max_tokens: int,
                      temperature: float, turns: int = 1, schemas: list[str] | None = None) -> dict:
    """``clients`` concurrent clients, each sending ``per_client`` conversations of ``turns``
    streaming requests in turn (a turn's prompt: the previous prompt, its answer, FOLLOW_UP).
    With ``schemas`` (JSON texts, one per prompt), each request is a chat message whose answer
    must match its schema (response_format json_schema)."""
    import openai

    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=3600)
    records: list[dict[str, Any]] = []  # one per request: key, ttft, tpot, tokens, text

    async def request(prompt: str, seed: int, schema: str | None):  # -> a stream of (text, usage) chunks
        options: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
                   "stream": True, "stream_options": {"include_usage": True}}
        if schema is None:
            async for chunk in await api.completions.create(prompt=prompt, **options):
                yield (chunk.choices[0].text if chunk.choices else ""), chunk.usage
            return
        response_format: Any = {"type": "json_schema", "json_schema": {"name": "answer", "schema": json.loads(schema)}}
        async for chunk in await api.chat.completions.create(messages=[{"role": "user", "content": prompt}],
                                                             response_format=response_format, **options):
            yield (chunk.choices[0].delta.content or "" if chunk.choices else ""), chunk.usage

    async def one(key: str, prompt: str, seed: int, schema: str | None = None) -> str:
        sent = time.perf_counter()
        arrivals, pieces = [], []
        tokens = 0
        async for text, usage in request(prompt, seed, schema):
            if text:
                arrivals.append(time.perf_counter())
                pieces.append(text)
            if usage:
                tokens = usage.completion_tokens
        first = arrivals[0] if arrivals else time.perf_counter()
        per_token = (arrivals[-1] - first) / (tokens - 1) if tokens > 1 and arrivals else 0.0
        text = "".join(pieces)
        records.append({"key": key, "ttft": first - sent, "tpot": per_token, "tokens": tokens, "text": text})
        return text

    async def conversation(index: int) -> None:
        prompt = prompts[index % len(prompts)]
        schema = schemas[index % len(schemas)] if schemas else None
        for turn in range(turns):
            answer = await one(f"{index}.{turn}" if turns > 1 else str(index), prompt, index * turns + turn, schema)
            prompt = prompt + answer + FOLLOW_UP

    async def client(number: int) -> None:
        for turn in range(per_client):
            await conversation(number * per_client + turn)

    started = time.perf_counter()
    await asyncio.gather(*(client(number) for number in range(clients)))
    seconds = time.perf_counter() - started
    await api.close()
    tokens = sum(r["tokens"] for r in records)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_second": tokens / seconds,
            "ttft_median": statistics.median(r["ttft"] for r in records),
            "tpot_median": statistics.median(r["tpot"] for r in records),
            "texts": {r["key"]: r["text"] for r in records}}


def load_test(*args) -> dict:
    """closed_loop, run to the end (what the client process runs). A client's error comes back as
    a RuntimeError with its text (openai's exceptions cannot cross the process boundary)."""
    try:
        return asyncio.run(closed_loop(*args))
    except Exception as error:  # noqa: BLE001 - re-raised, picklable
        raise RuntimeError(f"a client failed: {type(error).__name__}: {error}") from None


def step_summary(before: dict, after: dict) -> dict:
    """Mean batch size and mean draft length over the steps between two snapshots of
    Scheduler.steps."""
    steps = {key: after[key] - before.get(key, 0) for key in after if after[key] - before.get(key, 0)}
    total = sum(steps.values()) or 1
    return {"steps": sum(steps.values()), "mean_batch": sum(b * n for (b, _), n in steps.items()) / total,
            "mean_draft_length": sum(g * n for (_, g), n in steps.items()) / total}


def acceptance_summary(before: dict, after: dict) -> dict:
    """Acceptance between two snapshots of ServerMetrics.totals: alpha (accepted / drafted), tokens
    per drafting step (accepted + 1), and the share of accepted tokens copied from the cache."""
    drafted, accepted, steps, cached = (after[key] - before[key]
                                        for key in ("drafted", "accepted", "drafting_steps", "from_cache"))
    return {"alpha": accepted / drafted if drafted else 0.0, "tokens_per_draft_step": 1 + accepted / steps if steps
            else 1.0, "accepted_from_cache": cached / accepted if accepted else 0.0}


def valid_share(texts: dict[str, str], schemas: list[str]) -> float:
    """The share of a round's answers that match their request's JSON schema (keys: request index)."""
    from specdec.bench.runner import output_matches
    from specdec.constraint import Constraint

    checks = [output_matches(Constraint("json_schema", schemas[int(key.split(".")[0]) % len(schemas)]), text)
              for key, text in texts.items()]
    return sum(bool(check) for check in checks) / len(checks) if checks else 0.0


def bench_serve(apps: dict, urls: dict, model: str, prompts: list[str], args: argparse.Namespace, progress,
                clients_process, schemas: list[str] | None = None) -> dict:
    """Every concurrency, every server (a speculation mode, or one with its cache off) in turn; the
    clients run in ``clients_process`` (another process, so that they never hold the server's
    interpreter lock)."""
    from specdec.core.drafts import suffix_caches

    rows, mismatches = [], []
    turns = args.turns if args.workload == "replay" else 1
    for clients in sorted(set(args.concurrency)):
        for app in apps.values():  # every measurement's first round starts with an empty cache
            for cache in suffix_caches(app.state.scheduler.engine.drafter):
                cache.clear()
        texts: dict[str, dict[str, str]] = {}  # per mode: request key -> its text
        rounds: dict[str, list[dict[str, Any]]] = {label: [] for label in apps}
        for round_number in range(args.repeats):
            for label, app in apps.items():
                progress(f"concurrency {clients}, speculation {label}, round {round_number + 1}/{args.repeats}")
                scheduler = app.state.scheduler
                before, totals = dict(scheduler.steps), dict(scheduler.metrics.totals)
                load = clients_process.submit(load_test, urls[label], model, prompts, clients,
                                              -(-args.requests // clients), args.max_new_tokens, args.temperature,
                                              turns, schemas).result()
                texts[label] = load.pop("texts")
                rounds[label].append({**load, **step_summary(before, dict(scheduler.steps)),
                                      **acceptance_summary(totals, scheduler.metrics.totals)})
                progress(f"concurrency {clients}, speculation {label}: {load['tokens_per_second']:.1f} tokens/s",
                         done=True)
        valid = {label: valid_share(texts[label], schemas) for label in apps} if schemas else {}
        for label in apps:  # the median round by throughput
            ordered = sorted(rounds[label], key=lambda r: r["tokens_per_second"])
            rows.append({"mode": label, "concurrency": clients, **ordered[len(ordered) // 2],
                         **({"valid_share": valid[label]} if schemas else {}),
                         "rounds_tokens_per_second": [r["tokens_per_second"] for r in rounds[label]],
                         "rounds_accepted_from_cache": [r["accepted_from_cache"] for r in rounds[label]]})
        if args.temperature == 0:
            reference, *others = apps
            for label in others:
                differ = [i for i in texts[reference] if texts[label].get(i) != texts[reference][i]]
                if differ:
                    mismatches.append(f"{label} vs {reference} at concurrency {clients}: requests {differ[:5]}")
    return {"rows": rows, "mismatches": mismatches}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (throughput, latency) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in dict.fromkeys(r["mode"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["mode"] == mode]
        concurrency = [r["concurrency"] for r in rows]
        throughput.plot(concurrency, [r["tokens_per_second"] for r in rows], marker="o", label=f"speculation {mode}")
        latency.plot(concurrency, [1000 * r["tpot_median"] for r in rows], marker="o", label=f"speculation {mode}")
    for axes, label in (
        (throughput, "generated tokens / s (all clients)"),
        (latency, "median time per output token (ms)"),
    ):
        axes.set_xscale("log", base=2)
        axes.set_xlabel("concurrent clients")
        axes.set_ylabel(label)
        axes.legend()
    figure.suptitle(f"{result['target']} + {result['drafter']}, {result['machine']}, {result['date'][:10]}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
