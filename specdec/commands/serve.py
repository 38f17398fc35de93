"""`specdec serve`: the command line of the OpenAI-compatible server (specdec.serving)."""

from __future__ import annotations

import argparse
import os

from specdec.names import SPECULATION_MODES, help_formatter
from specdec.progress import waiting
from specdec.serving.connections import DEFAULT_READ_TIMEOUT, is_loopback
from specdec.serving.server import DEFAULT_PREFILL_CHUNK, DEFAULT_PREFIX_CACHE_ROWS, DEFAULT_SHUTDOWN_TIMEOUT, build_app


def add_parser(commands, add_model_options, add_drafting_options) -> None:
    """`specdec serve`."""
    serve = commands.add_parser(
        "serve", help="an OpenAI-compatible HTTP server with continuous batching",
        description="Serves /v1/completions, /v1/chat/completions (streaming or not), /v1/models, /health and "
                    "/metrics. Requests join and leave the running batch between steps; with --speculation auto "
                    "the draft length of each step comes from measured costs for the current batch size.",
        formatter_class=help_formatter())
    add_model_options(serve)
    add_drafting_options(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--speculation", default="auto", choices=SPECULATION_MODES,
                       help="auto: draft length per step from measured costs (0 when speculation does not pay); "
                            "on: always --gamma; off: never draft")
    serve.add_argument("--no-draft", action="store_true", help="serve the target alone")
    serve.add_argument("--max-batch", type=int, default=32, help="most requests decoded together (cache rows)")
    serve.add_argument("--max-waiting", type=int, default=1024, help="most queued requests; more get a 429")
    serve.add_argument("--max-tokens", type=int, default=2048, help="most new tokens one request may ask for")
    serve.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                       help="prompts go in pieces of this many tokens, between the decode steps of running streams "
                            "as many as cost about half a step (at least one), so a long prompt does not stall them")
    serve.add_argument("--prefix-cache-rows", type=int, default=DEFAULT_PREFIX_CACHE_ROWS,
                       help="recent prompts kept in this many spare cache rows; a prompt that begins like one of them "
                            "copies the shared part (whole prefill pieces: exact) instead of computing it (0: off)")
    serve.add_argument("--kv-cache-memory", metavar="SIZE",
                       help="memory for the KV cache, one pool of blocks that every request draws on, e.g. 6GiB "
                            "(default: a third of the memory available at start, at most every row's whole context)")
    serve.add_argument("--max-model-len", type=int,
                       help="the longest request, prompt and output, in tokens (default: the model's context, or "
                            "the pool if smaller); a longer prompt gets a 400")
    serve.add_argument("--served-model-name", help="the model name clients pass (default: the target's folder name)")
    serve.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY"),
                       help="every /v1 route needs 'Authorization: Bearer KEY' (default: $SPECDEC_API_KEY; "
                            "/health and /metrics stay open)")
    serve.add_argument("--max-body-bytes", type=int,
                       help="the largest request body read; more gets a 413 before parsing (default: 32 bytes per "
                            "context token, at least 1 MiB)")
    serve.add_argument("--max-grammar-bytes", type=int, default=256 * 1024,
                       help="the largest JSON schema, regex or grammar a request may give; more gets a 400")
    serve.add_argument("--grammar-timeout", type=float, default=20.0,
                       help="seconds a request's schema, regex or grammar may take to compile (on a worker thread, "
                            "not the serving loop); longer gets a 400")
    serve.add_argument("--read-timeout", type=float, default=DEFAULT_READ_TIMEOUT, metavar="SECONDS",
                       help="seconds a client has to send a request's headers, and then its body (a 408): a slow or "
                            "stalled client holds a connection no longer")
    serve.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT, metavar="SECONDS",
                       help="on SIGTERM or Ctrl-C, seconds running requests get to finish; those still running then "
                            "end with an error (a stream's last event, else a 503) and the server exits")
    from specdec.commands.options import add_acceptance_option

    add_acceptance_option(serve, " for requests whose body names no \"acceptance\"")


def run(args: argparse.Namespace, console, errors) -> int:
    from specdec.commands.models import load_drafting
    from specdec.serving.app import ServerLimits
    from specdec.serving.memory import kv_budget
    from specdec.serving.shutdown import graceful_server

    drafting = load_drafting(args, errors)
    target, config = drafting.target, drafting.config
    name = args.served_model_name or target.name
    budget = kv_budget(target, args.max_batch, args.prefix_cache_rows, args.kv_cache_memory, args.max_model_len)
    errors.print(budget.describe(args.max_batch) if budget else
                 f"KV cache: the {target.backend} backend's own (not sized here); --max-model-len "
                 f"{args.max_model_len or target.max_context}")
    with waiting(errors, "measuring verify costs (once per machine and model)") as update:
        app = build_app(target, None, name, gamma=config.chosen_gamma, speculation=config.speculation or "auto",
                        max_batch=args.max_batch, max_waiting=args.max_waiting,
                        limits=ServerLimits(max_tokens=args.max_tokens, api_key=args.api_key,
                                            max_body_bytes=args.max_body_bytes,
                                            max_grammar_bytes=args.max_grammar_bytes,
                                            grammar_seconds=args.grammar_timeout,
                                            read_timeout=args.read_timeout), progress=update,
                        prefill_chunk=args.prefill_chunk, prefix_cache_rows=args.prefix_cache_rows,
                        max_model_len=args.max_model_len, default_acceptance=config.acceptance, budget=budget,
                        make_engine=drafting.engine)
    from specdec.machine import seconds_since_start

    started = seconds_since_start()
    ready = f"ready {started:.1f} s after start; " if started is not None else ""
    errors.print(f"serving {name!r} on http://{args.host}:{args.port}/v1 ({ready}speculation: {args.speculation}"
                 f"{', API key required' if args.api_key else ''}"
                 f"{f', LOSSY acceptance {config.acceptance} by default' if config.acceptance != 'exact' else ''})")
    if not args.api_key and not is_loopback(args.host):
        errors.print(f"[yellow]warning: serving on {args.host} without an API key: anyone who can reach it can use "
                     "it (--api-key KEY or SPECDEC_API_KEY)[/]")
    graceful_server(app, args.host, args.port, args.shutdown_timeout).run()
    return 0
