"""llama.cpp's own command-line tools as `specdec bench` methods, on the same GGUF files.

    llama-target               llama-completion: the target alone (the llama.cpp engine's reference)
    llama-speculative[:N]      llama-speculative with the draft GGUF, at most N draft tokens (default 6)
    llama-lookup[:N]           llama-lookup: n-gram drafts from the context, at most N tokens (default 6)

Every call runs the binary once (the GGUFs stay in the page cache after the first), with the
flags that make it fast on a small CPU: `--poll 0` (with two models on 2 cores, busy-waiting
threadpools starve each other), `-t` the machine's cores, flash attention on. The time is the
tool's own prompt + generation time (model loading excluded, as for every other method). The
tools print text, not token ids: the text after the prompt is encoded with the target's tokenizer.
Re-encoding a string cut at the last generated token can merge that token with nothing after it
differently, so each tool is asked for `LOOKAHEAD` tokens more than the bench wants, the first
`max_new_tokens` re-encoded tokens are kept, and the generation time is scaled to the kept share.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from specdec.bench.runner import Method, MethodOutput
from specdec.metrics import SpecStats
from specdec.sampling import SamplingParams

LLAMA_CPP_METHODS = {"llama-target": "llama-completion", "llama-speculative": "llama-speculative",
                     "llama-lookup": "llama-lookup"}
LLAMA_CPP_REFERENCE = "llama-target"
DEFAULT_DRAFT_MAX = 6
LOOKAHEAD = 8


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
    if base == "llama-target":
        if setting:
            raise ValueError(f"{name!r}: llama-target takes no setting")
        return None
    if setting and not setting.isdigit():
        raise ValueError(f"{name!r}: the setting is a number of draft tokens, as in {base}:4")
    return int(setting) if setting else DEFAULT_DRAFT_MAX


def command_line(name: str, tools: LlamaCppTools, prompt: str, settings: SamplingParams,
                 prompt_tokens: int = 0) -> list[str]:
    """The tool's command for one prompt; its context (-c) holds the prompt and the generation,
    in whole 256-token steps (its own default, 4096, would cut a long prompt)."""
    base = name.partition(":")[0]
    context = max(4096, -(-(prompt_tokens + settings.max_new_tokens + 2 * LOOKAHEAD) // 256) * 256)
    command = [str(tools.bin_dir / LLAMA_CPP_METHODS[base]), "-m", str(tools.target_gguf), "-c", str(context),
               "-p", prompt, "--no-escape", "-n", str(settings.max_new_tokens + LOOKAHEAD),
               "--poll", "0", "-t", str(os.cpu_count() or 1), "-fa", "on",
               "--seed", str(settings.seed or 0), "--temp", str(settings.temperature),
               "--top-k", str(settings.top_k), "--top-p", str(settings.top_p), "--min-p", str(settings.min_p)]
    if base == "llama-target":
        command += ["-no-cnv"]
    else:
        command += ["--spec-draft-n-max", str(draft_max(name))]
    if base == "llama-speculative":
        command += ["-md", str(tools.draft_gguf)]
    return command


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
        done = subprocess.run(command_line(name, tools, prompt, settings, len(prompt_ids)), capture_output=True,
                              text=True)
        if done.returncode != 0:
            tail = " | ".join(done.stderr.strip().splitlines()[-3:])
            raise ToolError(f"{name} exited with {done.returncode}: {tail}")
        start = done.stdout.find(prompt)  # every tool echoes the prompt before its continuation
        if start < 0:
            raise ToolError(f"{name}: the prompt is not in the tool's output, so its continuation is unknown")
        token_ids = tokenizer.encode(done.stdout[start + len(prompt):], add_special_tokens=False)
        kept = token_ids[:settings.max_new_tokens]
        prompt_seconds, generation_seconds, produced = parse_timing(done.stderr)
        seconds = prompt_seconds + generation_seconds * min(1.0, len(kept) / max(produced, 1))
        stats = {key: int(value) for key, value in _STAT.findall(done.stderr)}
        spec = SpecStats(prompt_tokens=len(prompt_ids), generated_tokens=len(kept),
                         drafted=stats.get("n_drafted", 0), accepted=stats.get("n_accept", 0)) if stats else None
        return MethodOutput(kept, seconds, spec, prompt_seconds)

    return Method(name, run, engine="llama.cpp")
