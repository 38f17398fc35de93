"""Does `specdec serve`, with its defaults, answer long prompts, and what memory does it take?

Starts the server (its start line printed), sends one `/v1/completions` request per --chars value
at once (each the start of an installed source file cut at the first def past that many
characters: bench/long_suite.py's "continue" ask; files in turn: --modules, by default the long
suite's rich/console.py, pydantic/main.py, fastapi/routing.py), greedy, and prints each answer's
status, seconds and usage, and the server's resident memory before, at its peak (sampled every
0.5 s) and after.

    python benchmarks/cpu/serve_long_prompts.py [--target DIR] --chars 31000 [--chars ...] [--max-tokens 16]
        [--modules rich.console pydantic.main fastapi.routing click.core]
"""

import argparse
import importlib
import inspect
import json
import os
import subprocess
import sys
import threading
import time

import httpx

from specdec.bench.long_suite import SOURCES, ask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target")
    parser.add_argument("--chars", type=int, action="append", required=True)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--modules", nargs="+", default=list(SOURCES),
                        help="installed modules whose source the prompts start with, in turn")
    args = parser.parse_args()
    command = [sys.executable, "-m", "specdec", "serve", "--port", str(args.port),
               *(["--target", args.target] if args.target else [])]
    # A wide "terminal": the start line in one piece.
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "400"})
    lines: list[str] = []
    threading.Thread(target=lambda: [lines.append(line.rstrip()) for line in server.stderr], daemon=True).start()

    def rss_gib() -> float:
        with open(f"/proc/{server.pid}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 2**20

    url = f"http://127.0.0.1:{args.port}"
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            sys.exit("\n".join(lines) + "\nthe server exited")
        time.sleep(1)
    print("\n".join(line for line in lines if line.startswith(("KV cache", "serving"))))
    before, peak, done = rss_gib(), [0.0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_gib())
            time.sleep(0.5)

    threading.Thread(target=sample, daemon=True).start()
    sources = [inspect.getsource(importlib.import_module(name)) for name in args.modules]
    results: list = [None] * len(args.chars)

    def request(index: int, chars: int) -> None:
        started = time.time()
        reply = httpx.post(url + "/v1/completions", timeout=None, json={
            "prompt": ask("continue", sources[index % len(sources)], chars), "max_tokens": args.max_tokens,
            "temperature": 0})
        body = reply.json()
        results[index] = {"status": reply.status_code, "seconds": round(time.time() - started, 1),
                          "usage": body.get("usage") or body.get("error")}

    threads = [threading.Thread(target=request, args=(index, chars)) for index, chars in enumerate(args.chars)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    time.sleep(1)
    print(json.dumps({"requests": results, "rss_gib": {"before": round(before, 2), "peak": round(peak[0], 2),
                                                       "after": round(rss_gib(), 2)}}))
    server.terminate()
    server.wait(60)


if __name__ == "__main__":
    main()
