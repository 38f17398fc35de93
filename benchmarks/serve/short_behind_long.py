"""Time to first token of a short stream sent while N long prompts are being prefilled, against a
running `specdec serve`: N requests of LENGTH prompt tokens (ids, 16 new tokens each) at once,
then after DELAY seconds a streamed 32-token completion of a short prompt; prints one JSON line
(the short stream's first-token and total seconds, each long request's seconds) and appends it
to --out. Run it against two servers (two checkouts) to compare scheduling policies.

    specdec serve --port 8011 &
    python benchmarks/serve/short_behind_long.py http://127.0.0.1:8011 --long 2 --length 8000
"""

import argparse
import json
import threading
import time
from pathlib import Path

import httpx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("--long", type=int, default=2, help="long prompts sent at once")
    parser.add_argument("--length", type=int, default=8000, help="tokens in each long prompt")
    parser.add_argument("--delay", type=float, default=3.0, help="seconds before the short stream is sent")
    parser.add_argument("--out", type=Path, default=None, help="a JSON-lines file to append the result to")
    parser.add_argument("--salt", type=int, default=0, help="varies the long prompts' tokens (a server's prefix "
                        "cache must not hold them from a run before)")
    args = parser.parse_args()
    model = httpx.get(f"{args.url}/v1/models", timeout=60).json()["data"][0]["id"]
    long_seconds: dict[str, float] = {}

    def long_request(index: int) -> None:
        prompt = [(7 * position + 13 * index + 101 * args.salt) % 30000 + 100 for position in range(args.length)]
        started = time.perf_counter()
        reply = httpx.post(f"{args.url}/v1/completions", timeout=3600, json={
            "model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0})
        reply.raise_for_status()
        long_seconds[f"long_{index}"] = round(time.perf_counter() - started, 2)

    threads = [threading.Thread(target=long_request, args=(index,)) for index in range(args.long)]
    for thread in threads:
        thread.start()
    time.sleep(args.delay)
    started, first_token = time.perf_counter(), None
    short = {"model": model, "prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{args.url}/v1/completions", timeout=3600, json=short) as reply:
        for line in reply.iter_lines():
            if first_token is None and line.startswith("data: ") and line != "data: [DONE]":
                first_token = time.perf_counter() - started
    short_total = time.perf_counter() - started
    for thread in threads:
        thread.join()
    result = {"long_prompts": args.long, "length": args.length, "short_first_token_s": round(first_token or -1, 2),
              "short_total_s": round(short_total, 2), **long_seconds}
    print(json.dumps(result))
    if args.out is not None:
        with args.out.open("a") as file:
            file.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
