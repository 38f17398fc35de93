"""llama.cpp's own command-line tools as `specdec bench` methods, on the same GGUF files.

    llama-target               llama-completion: the target alone (the llama.cpp engine's reference)
    llama-speculative[:N]      llama-speculative with the draft GGUF, at most N draft tokens (default 6)
    llama-lookup[:N]           llama-lookup: n-gram drafts from the context, at most N tokens (default 6)
    llama-server-spec          llama-server --spec-default (its default speculation, n-gram drafts), one
                               /completion request to a server started for it; its own prompt and
                               generation timings

Every call runs the binary once (the GGUFs stay in the page cache after the first), with the
flags that make it fast on a small CPU: `--poll 0` (with two models on 2 cores, busy-waiting
threadpools starve each other), `-t` the machine's cores, flash attention on. The time is the
tool's own prompt + generation time (model loading excluded, as for every other method). The
tools print (the server returns) text, not token ids: the text after the prompt is encoded with the target's tokenizer.
Re-encoding a string cut at the last generated token can merge that token with nothing after it
differently, so each tool is asked for `LOOKAHEAD` tokens more than the bench wants, the first
`max_new_tokens` re-encoded tokens are kept, and the generation time is scaled to the kept share.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from specdec.bench.runner import Method, MethodOutput
from specdec.core.metrics import SpecStats
from specdec.core.sampling import SamplingParams

LLAMA_CPP_METHODS = {"llama-target": "llama-completion", "llama-speculative": "llama-speculative",
                     "llama-lookup": "llama-lookup", "llama-server-spec": "llama-server"}
LLAMA_CPP_REFERENCE = "llama-target"
DEFAULT_DRAFT_MAX = 6
LOOKAHEAD = 8
SERVER_START_SECONDS = 300  # a server that is not answering /health by then has failed


class ToolError(RuntimeError):
    """A llama.cpp tool failed or printed something this module cannot read."""


@dataclass(frozen=True)
class LlamaCppTools:
    """Where the binaries and the GGUF files are."""

    bin_dir: Path
    target_gguf: Path
    draft_gguf: Path | None = None

    def check(self, names: list[str]) -> None:
        """A one-line error before any model is timed, for every missing piece."""
        for path, what in [(self.bin_dir, "--llama-cpp-bin"), (self.target_gguf, "--target-gguf")]:
            if not path.exists():
                raise FileNotFoundError(f"{what}: {path} does not exist")
        for name in names:
            binary = self.bin_dir / LLAMA_CPP_METHODS[name.partition(":")[0]]
            if not os.access(binary, os.X_OK):
                raise FileNotFoundError(f"{name} needs {binary} (build it with ../shared/peers/build-llama-cpp.sh)")
            if name.startswith("llama-speculative") and (self.draft_gguf is None or not self.draft_gguf.is_file()):
                raise FileNotFoundError(f"{name} needs --draft-gguf FILE")


def is_llama_cpp_method(name: str) -> bool:
    return name.partition(":")[0] in LLAMA_CPP_METHODS


def draft_max(name: str) -> int | None:
    base, _, setting = name.partition(":")
    if base in ("llama-target", "llama-server-spec"):
        if setting:
            raise ValueError(f"{name!r}: {base} takes no setting")
        return None
    if setting and not setting.isdigit():
        raise ValueError(f"{name!r}: the setting is a number of draft tokens, as in {base}:4")
    return int(setting) if setting else DEFAULT_DRAFT_MAX


def command_line(name: str, tools: LlamaCppTools, prompt: str, settings: SamplingParams,
                 prompt_tokens: int = 0) -> list[str]:
    """The tool's command for one prompt; its context (-c) holds the prompt and the generation,
    in whole 256-token steps (its own default, 4096, would cut a long prompt)."""
    base = name.partition(":")[0]
    command = [str(tools.bin_dir / LLAMA_CPP_METHODS[base]), "-m", str(tools.target_gguf),
               "-c", str(context_size(prompt_tokens, settings)),
               "-p", prompt, "--no-escape", "-n", str(settings.max_new_tokens + LOOKAHEAD),
               "--poll", "0", "-t", str(os.cpu_count() or 1), "-fa", "on",
               "--seed", str(settings.seed or 0), "--temp", str(settings.temperature),
               "--top-k", str(settings.top_k), "--top-p", str(settings.top_p), "--min-p", str(settings.min_p)]
    if base == "llama-target":
        # special tokens printed as text (llama-lookup prints them anyway): a chat-templated prompt is
        # echoed as sent, so its continuation is found
        command += ["-no-cnv", "--special"]
    else:  # (their prompt goes in as one batch: a prompt longer than the default 2048 stops them)
        batch = str(context_size(prompt_tokens, settings))
        command += ["--spec-draft-n-max", str(draft_max(name)), "-b", batch, "-ub", batch]
    if base == "llama-speculative":
        command += ["-md", str(tools.draft_gguf)]
    return command


def context_size(prompt_tokens: int, settings: SamplingParams) -> int:
    return max(4096, -(-(prompt_tokens + settings.max_new_tokens + 2 * LOOKAHEAD) // 256) * 256)


def server_command(tools: LlamaCppTools, context: int, port: int) -> list[str]:
    """llama-server with its default speculation, one slot, the tools' fast flags."""
    return [str(tools.bin_dir / LLAMA_CPP_METHODS["llama-server-spec"]), "-m", str(tools.target_gguf),
            "-c", str(context), "--host", "127.0.0.1", "--port", str(port), "-np", "1", "--spec-default",
            "--poll", "0", "-t", str(os.cpu_count() or 1), "-fa", "on"]


_COUNTED = re.compile(r"(encoded|decoded)\s+(\d+) tokens in\s+([\d.]+) seconds")
_PERF = re.compile(r"(prompt eval|\beval) time =\s+([\d.]+) ms /\s+(\d+)")
_STAT = re.compile(r"\b(n_drafted|n_accept)\s*=\s*(\d+)")


def parse_timing(log: str) -> tuple[float, float, int]:
    """(prompt seconds, generation seconds, tokens generated) from a tool's log."""
    counted = {kind: (int(count), float(seconds)) for kind, count, seconds in _COUNTED.findall(log)}
    if "decoded" in counted:  # llama-speculative, llama-lookup
        return counted.get("encoded", (0, 0.0))[1], counted["decoded"][1], counted["decoded"][0]
    perf = {kind: (float(ms) / 1000, int(count)) for kind, ms, count in _PERF.findall(log)}
    if "eval" not in perf or "prompt eval" not in perf:
        raise ToolError("no timing in the llama.cpp log (was it built with another log format?)")
    # The first token comes from the prompt's forward; each eval run adds one.
    return perf["prompt eval"][0], perf["eval"][0], perf["eval"][1] + 1


def llama_cpp_method(name: str, tools: LlamaCppTools, tokenizer) -> Method:
    draft_max(name)  # a bad setting fails before anything runs

    def run(prompt_ids: list[int], settings: SamplingParams) -> MethodOutput:
        prompt = tokenizer.decode(prompt_ids)
        if name.startswith("llama-server"):
            return output(tokenizer, prompt_ids, settings, *ask_server(tools, prompt, settings, len(prompt_ids)))
        # errors="replace": a continuation cut inside a character (or a random model's bytes) is not UTF-8
        done = subprocess.run(command_line(name, tools, prompt, settings, len(prompt_ids)), capture_output=True,
                              text=True, encoding="utf-8", errors="replace")
        if done.returncode != 0:
            tail = " | ".join(done.stderr.strip().splitlines()[-3:])
            raise ToolError(f"{name} exited with {done.returncode}: {tail}")
        start = done.stdout.find(prompt)  # every tool echoes the prompt before its continuation
        if start < 0:
            raise ToolError(f"{name}: the prompt is not in the tool's output, so its continuation is unknown")
        stats = {key: int(value) for key, value in _STAT.findall(done.stderr)}
        return output(tokenizer, prompt_ids, settings, done.stdout[start + len(prompt):], *parse_timing(done.stderr),
                      stats.get("n_drafted"), stats.get("n_accept"))

    return Method(name, run, engine="llama.cpp")


def output(tokenizer, prompt_ids: list[int], settings: SamplingParams, continuation: str, prompt_seconds: float,
           generation_seconds: float, produced: int, drafted: int | None, accepted: int | None) -> MethodOutput:
    """A tool's continuation as the bench's tokens, its time scaled to the tokens kept."""
    token_ids = tokenizer.encode(continuation, add_special_tokens=False)
    kept = token_ids[:settings.max_new_tokens]
    seconds = prompt_seconds + generation_seconds * min(1.0, len(kept) / max(produced, 1))
    spec = None if drafted is None else SpecStats(prompt_tokens=len(prompt_ids), generated_tokens=len(kept),
                                                  drafted=drafted, accepted=accepted or 0)
    return MethodOutput(kept, seconds, spec, prompt_seconds)


def ask_server(tools: LlamaCppTools, prompt: str, settings: SamplingParams,
               prompt_tokens: int) -> tuple[str, float, float, int, int | None, int | None]:
    """(continuation, prompt seconds, generation seconds, tokens generated, drafted, accepted) of
    one /completion request to a llama-server started for it (and stopped after)."""
    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    body = {"prompt": prompt, "n_predict": settings.max_new_tokens + LOOKAHEAD, "temperature": settings.temperature,
            "top_k": settings.top_k, "top_p": settings.top_p, "min_p": settings.min_p, "seed": settings.seed or 0,
            "cache_prompt": False}
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(server_command(tools, context_size(prompt_tokens, settings), port),
                                  stdout=subprocess.DEVNULL, stderr=log)
        try:
            wait_for_health(server, url, log)
            request = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request) as reply:
                answer = json.loads(reply.read())
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
    timings = answer.get("timings") or {}
    if "prompt_ms" not in timings or "predicted_ms" not in timings:
        raise ToolError("llama-server's reply has no timings (was it built with another API?)")
    return (answer.get("content", ""), timings["prompt_ms"] / 1000, timings["predicted_ms"] / 1000,
            int(timings.get("predicted_n", 0)), timings.get("draft_n"), timings.get("draft_n_accepted"))


def wait_for_health(server: subprocess.Popen, url: str, log) -> None:
    """Until the server answers /health (its model loaded), or it exits, or SERVER_START_SECONDS pass."""
    deadline = time.monotonic() + SERVER_START_SECONDS
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            tail = " | ".join(log.read().decode(errors="replace").strip().splitlines()[-3:])
            raise ToolError(f"llama-server exited with {server.returncode}: {tail}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:  # not listening yet (URLError is an OSError), or loading (503)
            pass
        time.sleep(0.2)
    raise ToolError(f"llama-server did not answer /health within {SERVER_START_SECONDS} s")
