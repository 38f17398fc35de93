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
import contextlib
import datetime
import json
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from specdec.names import help_formatter


def add_parser(commands, add_model_options, add_drafting_options) -> None:
    parser = commands.add_parser("bench-serve", help="server throughput and latency vs concurrency "
                                 "(speculation on / off / auto)", formatter_class=help_formatter())
    add_model_options(parser)
    add_drafting_options(parser)
    parser.add_argument("--no-draft", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--modes", nargs="+", default=["off", "on", "auto"], choices=["off", "on", "auto"])
    parser.add_argument("--requests", type=int, default=32,
                        help="requests per measurement, spread over the clients (at least one each)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per measurement; the median round is kept")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompts", help="JSON prompt file (default: the bundled suite; the editing suite for "
                                          "--workload replay)")
    parser.add_argument("--workload", choices=["suite", "replay", "json", "long-prompt"], default="suite",
                        help="suite: one request per prompt; replay: conversations of --turns requests, each resending "
                             "the earlier answers with a follow-up; json: chat requests with response_format "
                             "json_schema (the JSON-extraction suite: docs/structured.md); long-prompt: C streams, "
                             "then a long prompt: the streams' gaps and its TTFT (bench/serve_long.py)")
    parser.add_argument("--long-words", type=int, default=1500, help="--workload long-prompt: words in the long prompt")
    parser.add_argument("--long-delay", type=float, default=3.0,
                        help="--workload long-prompt: seconds after the streams start that the long prompt comes")
    parser.add_argument("--long-max-tokens", type=int, default=16, help="--workload long-prompt: its new tokens")
    parser.add_argument("--turns", type=int, default=3, help="requests per conversation (--workload replay)")
    parser.add_argument("--compare-cache", action="store_true",
                        help="also run each speculating mode with the suffix drafter's cross-request cache off")
    parser.add_argument("--prefix-cache-rows", type=int, default=None,
                        help="spare cache rows for recent prompts (specdec serve's; default: serve's default, 0: off)")
    parser.add_argument("--out", default="runs/bench-serve")


#: What a replayed conversation's next turn adds after the previous answer.
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
    from specdec.drafting.base import suffix_caches

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


def run(args: argparse.Namespace, console, errors, load_drafting) -> int:
    from rich.table import Table

    from specdec.bench.suite import load_prompts, machine_description
    from specdec.defaults import default_prompts, editing_prompts, json_prompts
    from specdec.drafting.base import suffix_caches
    from specdec.serving.server import build_app, profile_grid, serve_in_thread
    from specdec.serving.speculation import profile_verify_costs

    # (the long-prompt workload takes 0 streams: the long prompt alone, a short request behind it)
    if min(args.concurrency) < (0 if args.workload == "long-prompt" else 1) or args.requests < 1 or \
            args.repeats < 1 or args.turns < 1:
        raise ValueError("--concurrency, --requests, --repeats and --turns must be positive (--concurrency 0: "
                         "--workload long-prompt only)")
    target, make_drafter = load_drafting(args, errors)
    drafters = {mode: make_drafter() for mode in args.modes}  # each server its own drafter (and suffix cache)
    if args.compare_cache:
        if not any(suffix_caches(drafter) for drafter in drafters.values()):
            raise ValueError("--compare-cache needs a drafter with a suffix cache (suffix, suffix-tree, suffix-or-X)")
        drafters.update({f"{mode}, no cache": make_drafter(suffix_cache_tokens=0) for mode in args.modes
                         if mode != "off"})
    default = {"replay": editing_prompts(), "json": json_prompts()}.get(args.workload, default_prompts())
    suite = load_prompts(Path(args.prompts) if args.prompts else default)
    prompts = [p.text for p in suite]
    schemas = None
    if args.workload == "json":
        if any(p.constraint is None or p.constraint.kind != "json_schema" for p in suite):
            raise ValueError("--workload json needs a suite whose every prompt has a json_schema")
        schemas = [p.constraint.source for p in suite if p.constraint is not None]
    # long-prompt: specdec serve's default rows (32), or one more than the streams
    max_batch = max(args.concurrency) if args.workload != "long-prompt" else max(32, max(args.concurrency) + 1)
    with errors.status("bench-serve") as status:
        costs = None
        if "auto" in args.modes:
            costs = profile_verify_costs(target, *profile_grid(max_batch, args.gamma),
                                         progress=lambda message: status.update(f"bench-serve: {message}"))
        prefix_rows = {} if args.prefix_cache_rows is None else {"prefix_cache_rows": args.prefix_cache_rows}
        apps = {label: build_app(target, drafter, "bench", gamma=args.gamma, speculation=label.split(",")[0],
                                 max_batch=max_batch, costs=costs, **prefix_rows)
                for label, drafter in drafters.items()}
        with contextlib.ExitStack() as servers:
            urls = {label: servers.enter_context(serve_in_thread(app)) for label, app in apps.items()}
            clients = servers.enter_context(ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")))
            for label in apps:  # warm up every server once
                clients.submit(load_test, urls[label], "bench", prompts, 1, 1, 8, args.temperature).result()

            def progress(label: str, done: bool = False) -> None:
                # Finished measurements as lines (readable in a log that is not a terminal).
                errors.print(label) if done else status.update(f"bench-serve: {label}")

            if args.workload == "long-prompt":
                from specdec.bench.serve_long import run_long_prompt

                result: dict[str, Any] = {"rows": run_long_prompt(args, apps, urls, progress, clients)}
            else:
                result = bench_serve(apps, urls, "bench", prompts, args, progress, clients, schemas)
    result.update(
        {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": machine_description(),
            "target": target.name,
            "drafter": f"{args.drafter} gamma {args.gamma}",
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "requests": args.requests,
            "workload": args.workload,
            "turns": args.turns if args.workload == "replay" else 1,
            "prefix_cache_rows": args.prefix_cache_rows,  # None: specdec serve's default
            "repeats": args.repeats,
        }
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.workload == "long-prompt":
        from specdec.bench.serve_long import print_table

        result.update({"long_words": args.long_words, "long_delay": args.long_delay})
        print_table(console, result["rows"], f"bench-serve long prompt: {result['target']}, {result['machine']}, "
                                             f"{result['date']}")
        (out / "serve-long-prompt.json").write_text(json.dumps(result, indent=1))
        errors.print(f"wrote {out / 'serve-long-prompt.json'}")
        return 1 if any(row["streams_over_bar"] for row in result["rows"]) else 0
    table = Table(title=f"bench-serve: {result['target']}, {result['machine']}, {result['date']}")
    columns = ("concurrency", "speculation", "tokens/s", "1st round", "vs off", "TTFT ms", "TPOT ms", "batch",
               "draft len", "alpha", "tokens/step", "from cache")
    for column in columns:
        table.add_column(column, justify="right")
    for row in result["rows"]:
        off = next((r for r in result["rows"] if r["mode"] == "off" and r["concurrency"] == row["concurrency"]), None)
        row["vs_off"] = row["tokens_per_second"] / off["tokens_per_second"] if off else None
        table.add_row(str(row["concurrency"]), row["mode"], f"{row['tokens_per_second']:.1f}",
                      f"{row['rounds_tokens_per_second'][0]:.1f}", f"{row['vs_off']:.2f}x" if off else "-",
                      f"{1000 * row['ttft_median']:.0f}", f"{1000 * row['tpot_median']:.1f}",
                      f"{row['mean_batch']:.1f}", f"{row['mean_draft_length']:.1f}", f"{row['alpha']:.2f}",
                      f"{row['tokens_per_draft_step']:.2f}", f"{row['accepted_from_cache']:.0%}")
    console.print(table)
    if schemas:
        errors.print("answers that match their schema: " + ", ".join(
            f"{row['mode']} at {row['concurrency']}: {row['valid_share']:.0%}" for row in result["rows"]))
    (out / "serve.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "serve.png")
    errors.print(f"wrote {out / 'serve.json'} and {out / 'serve.png'}")
    if result["mismatches"]:
        errors.print("[red]greedy texts differ between modes:[/] " + "; ".join(result["mismatches"][:5]))
        return 1
    return 0
