"""`specdec bench-serve`: a server under load, side by side with each speculation mode (specdec.bench.serve)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from specdec.bench.serve import bench_serve, load_test, plot
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
def run(args: argparse.Namespace, console, errors) -> int:
    from rich.table import Table

    from specdec.bench.suite import load_prompts, machine_description
    from specdec.commands.models import load_drafting
    from specdec.core.drafts import suffix_caches
    from specdec.defaults import default_prompts, editing_prompts, json_prompts
    from specdec.serving.in_thread import serve_in_thread
    from specdec.serving.server import build_app, profile_grid
    from specdec.serving.speculation import profile_verify_costs

    # (the long-prompt workload takes 0 streams: the long prompt alone, a short request behind it)
    if min(args.concurrency) < (0 if args.workload == "long-prompt" else 1) or args.requests < 1 or \
            args.repeats < 1 or args.turns < 1:
        raise ValueError("--concurrency, --requests, --repeats and --turns must be positive (--concurrency 0: "
                         "--workload long-prompt only)")
    drafting = load_drafting(args, errors)
    target, config = drafting.target, drafting.config
    # Each server builds its own engine, with a drafter (and suffix cache) of its own.
    makers: dict[str, Callable[..., Any]] = {mode: drafting.engine for mode in args.modes}
    if args.compare_cache:
        if not suffix_caches(drafting.engine().drafter):
            raise ValueError("--compare-cache needs a drafter with a suffix cache (suffix, suffix-tree, suffix-or-X)")
        uncached = functools.partial(drafting.engine, drafter_options={"suffix_cache_tokens": 0})
        makers.update({f"{mode}, no cache": uncached for mode in args.modes if mode != "off"})
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
            costs = profile_verify_costs(target, *profile_grid(max_batch, config.chosen_gamma),
                                         progress=lambda message: status.update(f"bench-serve: {message}"))
        prefix_rows = {} if args.prefix_cache_rows is None else {"prefix_cache_rows": args.prefix_cache_rows}
        apps = {label: build_app(target, None, "bench", gamma=config.chosen_gamma, speculation=label.split(",")[0],
                                 max_batch=max_batch, costs=costs, make_engine=make, **prefix_rows)
                for label, make in makers.items()}
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
            "drafter": f"{config.drafter} gamma {config.chosen_gamma}",
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
