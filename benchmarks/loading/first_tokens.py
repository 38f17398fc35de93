"""Start-up cost side by side: wall time and peak resident memory of whole commands (a process
each: imports, loading, the first tokens), run alternately for several rounds, with a table and
JSON. What issue 77 measures: `specdec generate --target DIR ... --max-new-tokens 4` against
`llama-completion` on the same model, and a server's time until it listens.

    python benchmarks/loading/first_tokens.py --rounds 3 --out runs/first-tokens \\
        "specdec=specdec generate --target $M/qwen2.5-coder-1.5b 'def f(x):' --max-new-tokens 4 --no-compare" \\
        "llama-completion=$LLAMA/llama-completion -m $GGUF -p 'def f(x):' -n 4 -t 2 -no-cnv"
    # a server: time until the first line that contains --ready-line, then stopped
    python benchmarks/loading/first_tokens.py --ready-line serving "serve=specdec serve --target ..."

Each NAME=COMMAND runs through the shell; the peak is the process tree's largest (wait4's
ru_maxrss of the shell's children). Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table


def run_once(command: str, ready_line: str | None) -> dict:
    """Seconds until the command exits (or prints ``ready_line`` on stdout or stderr, then it is
    stopped), its peak resident bytes, and its last lines."""
    started = time.perf_counter()
    process = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    lines: list[str] = []
    seconds = None
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line.rstrip())
        if ready_line and ready_line in line:
            seconds = time.perf_counter() - started
            os.killpg(process.pid, signal.SIGINT)
            break
    if ready_line and seconds is not None:
        for line in process.stdout:  # drain what it says while stopping
            lines.append(line.rstrip())
    _, status, usage = os.wait4(process.pid, 0)
    if seconds is None:
        seconds = time.perf_counter() - started
    return {"seconds": round(seconds, 3), "peak_bytes": usage.ru_maxrss * 1024,
            "exit": os.waitstatus_to_exitcode(status), "tail": lines[-6:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("commands", nargs="+", metavar="NAME=COMMAND")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ready-line", default=None, help="stop each command at the first line containing this")
    parser.add_argument("--out", type=Path, default=Path("runs/first-tokens"))
    args = parser.parse_args()
    named = dict(command.split("=", 1) for command in args.commands)
    runs: dict[str, list[dict]] = {name: [] for name in named}
    for round_index in range(args.rounds):
        for name, command in named.items():
            result = run_once(command, args.ready_line)
            runs[name].append(result)
            print(f"round {round_index + 1} {name}: {result['seconds']:.2f} s, "
                  f"{result['peak_bytes'] / 2**30:.2f} GiB, exit {result['exit']}", file=sys.stderr, flush=True)
    table = Table(title=f"start-up, {args.rounds} rounds alternated (median)")
    for column in ("command", "wall s", "peak GiB", "wall s each", "exit"):
        table.add_column(column)
    summary = {}
    for name, results in runs.items():
        seconds = statistics.median(result["seconds"] for result in results)
        peak = statistics.median(result["peak_bytes"] for result in results)
        summary[name] = {"median_seconds": seconds, "median_peak_bytes": peak}
        table.add_row(name, f"{seconds:.2f}", f"{peak / 2**30:.2f}",
                      " ".join(f"{result['seconds']:.2f}" for result in results),
                      ",".join(str(result["exit"]) for result in results))
    Console().print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    isa = sorted({flag for flag in Path("/proc/cpuinfo").read_text().split()
                  if flag in ("avx2", "avx512_vnni", "amx_int8")}) if Path("/proc/cpuinfo").is_file() else []
    (args.out / "results.json").write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": platform.processor() or platform.machine(),
        "isa": isa, "cpus": os.cpu_count(), "commands": named, "summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
