"""Requests that do not fit a server's KV pool together (issue 79): N prompts of LENGTH token ids,
NEW tokens each, greedy, at once against a running `specdec serve --kv-cache-memory 64MiB`; then
each alone on the same server. Prints, per workload, the statuses and whether each text equals its
request's alone, and the server's preemption count.

    specdec serve --port 8013 --kv-cache-memory 64MiB &
    python benchmarks/serve/pool_pressure.py http://127.0.0.1:8013
"""

import argparse
import json
import threading

import httpx

WORKLOADS = ((4, 820, 400, 5), (5, 520, 300, 9))  # (requests, prompt tokens, new tokens, salt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    args = parser.parse_args()
    model = httpx.get(f"{args.url}/v1/models", timeout=60).json()["data"][0]["id"]

    def run(prompts: list[list[int]], new_tokens: int) -> dict[int, tuple[int, str]]:
        answers: dict[int, tuple[int, str]] = {}

        def one(index: int) -> None:
            reply = httpx.post(f"{args.url}/v1/completions", timeout=1800, json={
                "model": model, "prompt": prompts[index], "max_tokens": new_tokens, "temperature": 0})
            text = reply.json()["choices"][0]["text"] if reply.status_code == 200 else reply.text[:200]
            answers[index] = (reply.status_code, text)

        threads = [threading.Thread(target=one, args=(index,)) for index in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return answers

    for count, length, new_tokens, salt in WORKLOADS:
        prompts = [[(11 * i + 17 * k + salt) % 30000 + 100 for i in range(length)] for k in range(count)]
        together = run(prompts, new_tokens)
        alone = {index: run([prompts[index]], new_tokens)[0] for index in range(count)}
        print(json.dumps({"requests": count, "prompt": length, "new": new_tokens,
                          "statuses": sorted(status for status, _ in together.values()),
                          "texts_equal_alone": [together[index] == alone[index] for index in range(count)]}))
    metrics = httpx.get(f"{args.url}/metrics", timeout=60).text
    print([line for line in metrics.splitlines() if line.startswith("specdec:num_preemptions_total")])


if __name__ == "__main__":
    main()
