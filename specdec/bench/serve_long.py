"""`specdec bench-serve --workload long-prompt`: does a long prompt stall the running streams?

C streams start together (prompts ``def f{i}(x):``, --max-new-tokens each, greedy); --long-delay
seconds later one request with a prompt of "# " and --long-words words arrives, and BEHIND_SECONDS
after it a short one (8 tokens of "def g(x):"). Recorded per stream: the gaps between its chunks
(median and worst), and whether the worst stays under 10x its median + 0.5 s (the bar of issue
51: a long prompt goes in pieces between the streams' steps, never whole); for the long request
and the short one behind it: their times to first token (C = 0: the long prompt alone, which
must not hold the short one back either).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
import time

#: A stream's worst gap must stay under STALL_FACTOR x its median gap + STALL_SLACK seconds.
STALL_FACTOR, STALL_SLACK = 10.0, 0.5
BEHIND_SECONDS = 1.0  # after the long prompt, the short request
WORDS = ("the", "model", "reads", "a", "long", "prompt", "while", "other", "streams", "decode", "their", "tokens",
         "and", "each", "step", "feeds", "piece", "of", "it", "between", "them", "so", "no", "stream", "waits")


def long_text(words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "# " + " ".join(rng.choice(WORDS) for _ in range(words))


async def long_prompt_round(url: str, model: str, streams: int, max_tokens: int, delay: float, words: int,
                            long_max_tokens: int, seed: int = 0) -> dict:
    """One round of the scenario against a running server; gap statistics per stream. ``seed``:
    the long prompt's words (a new one each round, or the server's prefix cache would hold it)."""
    import openai

    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=3600)

    async def stream(prompt: str, tokens: int) -> tuple[float, list[float], int]:
        sent, arrivals, prompt_tokens = time.perf_counter(), [], 0
        async for chunk in await api.completions.create(model=model, prompt=prompt, max_tokens=tokens,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].text:
                arrivals.append(time.perf_counter())
            if chunk.usage:
                prompt_tokens = chunk.usage.prompt_tokens
        return sent, arrivals, prompt_tokens

    async def late() -> tuple[float, list[float], int]:
        await asyncio.sleep(delay)
        return await stream(long_text(words, seed), long_max_tokens)

    async def behind() -> tuple[float, list[float], int]:
        await asyncio.sleep(delay + BEHIND_SECONDS)
        return await stream("def g(x):", 8)

    began = time.perf_counter()
    *short, long, short_behind = await asyncio.gather(
        *(stream(f"def f{i}(x):", max_tokens) for i in range(streams)), late(), behind())
    await api.close()
    gaps = []
    for _, arrivals, _ in short:
        own = [b - a for a, b in itertools.pairwise(arrivals)]
        if own:
            median, worst = statistics.median(own), max(own)
            at = arrivals[own.index(worst)] - began  # where the worst gap began, seconds into the round
            gaps.append({"median": median, "worst": worst, "worst_at": at, "last_at": arrivals[-1] - began,
                         "ok": worst < STALL_FACTOR * median + STALL_SLACK})
    sent, arrivals, prompt_tokens = long
    behind_sent, behind_arrivals, _ = short_behind
    return {"streams": streams, "long_prompt_tokens": prompt_tokens, "long_sent_at": sent - began,
            "long_ttft": (arrivals[0] - sent) if arrivals else None,
            "behind_ttft": (behind_arrivals[0] - behind_sent) if behind_arrivals else None,
            "gap_median": statistics.median(g["median"] for g in gaps) if gaps else None,
            "gap_worst": max(g["worst"] for g in gaps) if gaps else None,
            "streams_over_bar": sum(not g["ok"] for g in gaps), "per_stream": gaps}


def long_prompt_test(*args) -> dict:
    """long_prompt_round, run to the end in the clients' process (so that the clients never hold
    the server's interpreter lock, nor the server theirs)."""
    try:
        return asyncio.run(long_prompt_round(*args))
    except Exception as error:  # noqa: BLE001 - re-raised, picklable
        raise RuntimeError(f"a client failed: {type(error).__name__}: {error}") from None


def run_long_prompt(args, apps: dict, urls: dict, progress, clients_process) -> list[dict]:
    """Every server (speculation mode) and every concurrency in turn, --repeats rounds each."""
    rows = []
    seeds = itertools.count()
    for streams in sorted(set(args.concurrency)):
        for label in apps:
            for round_number in range(args.repeats):
                progress(f"long prompt beside {streams} streams, speculation {label}, round {round_number + 1}")
                row = clients_process.submit(long_prompt_test, urls[label], "bench", streams, args.max_new_tokens,
                                             args.long_delay, args.long_words, args.long_max_tokens,
                                             next(seeds)).result()
                rows.append({"mode": label, **row})
                gaps = "" if row["gap_median"] is None else (
                    f"gaps median {row['gap_median']:.2f} s, worst {row['gap_worst']:.2f} s, "
                    f"{row['streams_over_bar']} over the bar; ")
                progress(f"{streams} streams, {label}: {gaps}long prompt ({row['long_prompt_tokens']} tokens) TTFT "
                         f"{seconds(row['long_ttft'])} s, the short request behind it {seconds(row['behind_ttft'])} s",
                         done=True)
    return rows


def print_table(console, rows: list[dict], title: str) -> None:
    from rich.table import Table

    table = Table(title=title)
    for column in ("streams", "speculation", "gap median s", "gap worst s", f"over {STALL_FACTOR:g}x + "
                   f"{STALL_SLACK:g} s", "long prompt tokens", "long TTFT s", "short behind it: TTFT s"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(str(row["streams"]), row["mode"], seconds(row["gap_median"]), seconds(row["gap_worst"]),
                      str(row["streams_over_bar"]), str(row["long_prompt_tokens"]), seconds(row["long_ttft"]),
                      seconds(row["behind_ttft"]))
    console.print(table)


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
