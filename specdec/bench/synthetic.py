"""`specdec bench --synthetic`: engine efficiency on big random-weight shapes.

A ~300M-parameter target and a ~30M draft are built with random weights (nothing to download).
The drafter runs the real draft model, so drafting costs what it would, but proposes the target's
own greedy continuation (known from an untimed target-only run) with each token replaced by a
random other token with probability 1 - alpha. Acceptance is then exactly the i.i.d. model of
Leviathan et al. (2023), and the measured speedup can be held against the formula's prediction
from the measured draft/target cost ratio c and the verify-cost curve T(k)/T(1). Target-only
time per token is held against the memory-bandwidth bound: streamed weight bytes / measured
streaming bandwidth.
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from specdec.bench.forward import time_forward
from specdec.bench.oracle import CorruptedOracleDrafter
from specdec.bench.runner import (
    Method,
    MethodOutput,
    Prompt,
    run_side_by_side,
    speculative_method,
    write_json,
)
from specdec.core.estimates import predicted_speedup
from specdec.core.sampling import SamplingParams
from specdec.decoder import SpeculativeDecoder
from specdec.models.base import LanguageModel

REFERENCE = "target-only"
HEAD_DIM = 64
PRECISIONS = ("fp32", "int8", "int4")


@dataclass(frozen=True)
class Shape:
    """A Llama shape from hidden size and depth: 64-dim heads, 4 query heads per kv head,
    MLP width 2.75 x hidden (rounded to 64), tied embeddings."""

    hidden: int
    layers: int
    vocab: int

    @staticmethod
    def parse(text: str, vocab: int) -> Shape:
        """"1024x24" -> hidden 1024, 24 layers."""
        try:
            hidden, layers = (int(part) for part in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"a shape is HIDDENxLAYERS such as 1024x24, got {text!r}") from None
        if hidden % HEAD_DIM or hidden <= 0 or layers <= 0:
            raise ValueError(f"shape {text!r}: hidden must be a positive multiple of {HEAD_DIM} and layers positive")
        return Shape(hidden, layers, vocab)

    @property
    def heads(self) -> int:
        return self.hidden // HEAD_DIM

    @property
    def kv_heads(self) -> int:
        return max(1, self.heads // 4)

    @property
    def intermediate(self) -> int:
        return max(64, round(self.hidden * 2.75 / 64) * 64)

    @property
    def parameters(self) -> int:
        attention = 2 * self.hidden * (self.heads + self.kv_heads) * HEAD_DIM
        per_layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden  # + two norms
        return self.vocab * self.hidden + self.layers * per_layer + self.hidden  # tied head, final norm

    def hf_config(self, max_positions: int):
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=self.vocab, hidden_size=self.hidden, num_hidden_layers=self.layers,
                           num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                           intermediate_size=self.intermediate, max_position_embeddings=max_positions,
                           tie_word_embeddings=True)


def random_model(shape: Shape, name: str, seed: int, quantize: str | None, max_positions: int = 1024) -> LanguageModel:
    """specdec's own forward with random weights (no tokenizer: prompts are token ids)."""
    from specdec.models.transformer import LlamaFamilyModel, TransformerConfig, rope_frequencies

    hf_config = shape.hf_config(max_positions)
    config = TransformerConfig.from_hf(hf_config)
    torch.manual_seed(seed)
    network = LlamaFamilyModel(config, rope_frequencies(hf_config, config))
    with torch.no_grad():  # transformers' initialisation: N(0, 0.02) everywhere, norms at 1
        for module in network.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, 0.02)
    network.eval()
    if quantize in ("int8", "int4"):
        from specdec.models.precisions import quantize_model

        quantize_model(network, quantize)
    elif quantize is not None:
        raise ValueError(f"unknown quantization {quantize!r}")
    return LanguageModel(network=network, tokenizer=None, name=name, vocab_size=shape.vocab,
                         max_context=max_positions)


def streamed_weight_bytes(network: nn.Module) -> int:
    """Bytes one decoding step reads: every linear weight (float, int8 or int4) and norm; the
    embedding table is only indexed one row per token, so it counts only where it doubles as the
    LM head."""
    from specdec.models.int4 import Int4Linear
    from specdec.models.quantize import Int8Linear

    total = 0
    for module in network.modules():
        if isinstance(module, nn.Embedding):
            continue
        tensors: list[torch.Tensor] = list(module.parameters(recurse=False))
        # Their weights live in buffers: int8's weight and per-channel scales; int4's codes, scales
        # and minimums in one.
        if isinstance(module, (Int8Linear, Int4Linear)):
            tensors += module.buffers(recurse=False)
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def streaming_bandwidth(megabytes: int = 512, repeats: int = 5) -> dict[str, float]:
    """Bytes per second the CPU streams from memory, median of `repeats`: a reduction (reads) and
    a copy (reads + writes). A buffer much larger than the caches makes this memory, not cache."""
    source = torch.ones(megabytes * 2**20 // 4)
    target = torch.empty_like(source)
    size = source.numel() * 4
    reads, copies = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        source.sum()
        reads.append(size / (time.perf_counter() - started))
        started = time.perf_counter()
        target.copy_(source)
        copies.append(2 * size / (time.perf_counter() - started))
    return {"read": statistics.median(reads), "copy": statistics.median(copies)}


@dataclass(frozen=True)
class SyntheticConfig:
    target: Shape = Shape(1024, 24, 32000)
    draft: Shape = Shape(512, 5, 32000)
    precisions: tuple[str, ...] = ("fp32", "int8")
    alphas: tuple[float, ...] = (0.5, 0.7, 0.9)
    gammas: tuple[int, ...] = (2, 4, 8)
    prompts: int = 4
    prompt_tokens: int = 16
    max_new_tokens: int = 48
    repeats: int = 7  # forward timings: median of this many
    seed: int = 0


def synthetic_method(name: str, decoder: SpeculativeDecoder, expected: dict[tuple[int, ...], list[int]]) -> Method:
    """speculative_method, telling an oracle drafter the sequence to expect first."""
    method = speculative_method(name, decoder)
    drafter = decoder.drafter

    def run(prompt_ids: list[int], settings: SamplingParams) -> MethodOutput:
        if isinstance(drafter, CorruptedOracleDrafter):
            drafter.expect(expected.get(tuple(prompt_ids), prompt_ids))
        return method.run(prompt_ids, settings)

    return Method(name, run)


#: progress(label, runs finished since the last call)
Progress = Callable[[str, int], None]


def measure_precision(config: SyntheticConfig, precision: str, progress: Progress | None = None) -> dict:
    """Cost curve, bandwidth bound and decoding runs for one precision ("fp32", "int8" or "int4")."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose from {', '.join(PRECISIONS)}")
    quantize = None if precision == "fp32" else precision
    say = progress or (lambda label, advance: None)
    say(f"{precision}: building random models", 0)
    target = random_model(config.target, f"random-{config.target.hidden}x{config.target.layers}", config.seed, quantize)
    draft = random_model(config.draft, f"random-{config.draft.hidden}x{config.draft.layers}", config.seed + 1, quantize)

    say(f"{precision}: timing forwards", 0)
    blocks = sorted({1, *(g + 1 for g in config.gammas)})
    target_seconds = {k: time_forward(target, k, config.repeats) for k in blocks}
    draft_seconds = time_forward(draft, 1, config.repeats)
    c = draft_seconds / target_seconds[1]

    generator = torch.Generator().manual_seed(config.seed)
    prompt_ids = {
        f"random-{i}": torch.randint(config.target.vocab, (config.prompt_tokens,), generator=generator).tolist()
        for i in range(config.prompts)
    }
    prompts = [Prompt("random", key, key) for key in prompt_ids]
    settings = SamplingParams(max_new_tokens=config.max_new_tokens)

    say(f"{precision}: target-only reference outputs", 0)  # untimed; also warms everything up
    reference_decoder = SpeculativeDecoder(target)
    expected = {
        tuple(ids): ids + reference_decoder.generate(ids, max_new_tokens=config.max_new_tokens).token_ids
        for ids in prompt_ids.values()
    }

    methods = [synthetic_method(REFERENCE, reference_decoder, expected)]
    for alpha in config.alphas:
        for gamma in config.gammas:
            drafter = CorruptedOracleDrafter(draft, alpha, config.target.vocab, seed=config.seed)
            methods.append(
                synthetic_method(f"alpha {alpha} gamma {gamma}", SpeculativeDecoder(target, drafter, gamma), expected)
            )
    run = run_side_by_side(
        methods,
        prompts,
        prompt_ids.__getitem__,
        settings,
        REFERENCE,
        lambda label: say(f"{precision}: {label}", 1),
        warmup=False,
    )
    run.raise_on_mismatch()
    measurements = run.measurements

    by_method: dict[str, list] = {}
    for m in measurements:
        by_method.setdefault(m.method, []).append(m)

    def rate(name: str) -> float:
        """Tokens per second of decode time: the prefill (the same for every method) is left out,
        as in Leviathan's formula."""
        rows = by_method[name]
        return sum(len(r.token_ids) for r in rows) / sum(r.seconds - r.stats.prefill_seconds for r in rows)

    baseline = rate(REFERENCE)
    runs = []
    for alpha in config.alphas:
        for gamma in config.gammas:
            name = f"alpha {alpha} gamma {gamma}"
            stats = by_method[name][0].stats
            for row in by_method[name][1:]:
                stats = stats.merge(row.stats)
            verify_ratio = target_seconds[gamma + 1] / target_seconds[1]
            runs.append(
                {
                    "alpha": alpha,
                    "gamma": gamma,
                    "tokens_per_second": rate(name),
                    "measured_speedup": rate(name) / baseline,
                    "predicted_speedup": predicted_speedup(alpha, gamma, c, verify_ratio),
                    # position 1's acceptance estimates alpha; stats.alpha (accepted / drafted) also counts
                    # the positions after a rejection: (alpha - alpha^(g+1)) / ((1 - alpha) g) in expectation
                    "first_position_acceptance": stats.acceptance_by_position[0],
                    "accepted_per_drafted": stats.alpha,
                    "tau": stats.tau,
                }
            )
    bandwidth = streaming_bandwidth()
    assert isinstance(target.network, nn.Module), "random_model builds specdec's own forward"
    weight_bytes = streamed_weight_bytes(target.network)
    return {
        "precision": precision,
        "target_parameters": config.target.parameters,
        "draft_parameters": config.draft.parameters,
        "target_forward_ms": {str(k): s * 1000 for k, s in target_seconds.items()},
        "draft_forward_ms": draft_seconds * 1000,
        "c": c,
        "target_only_tokens_per_second": baseline,
        "target_only_ms_per_token": 1000 / baseline,
        "streamed_weight_bytes": weight_bytes,
        "bandwidth_bytes_per_second": bandwidth,
        "bandwidth_bound_ms_per_token": 1000 * weight_bytes / max(bandwidth.values()),
        "runs": runs,
    }


def run_count(config: SyntheticConfig) -> int:
    """Decoding runs the bench makes (for a progress bar)."""
    return len(config.precisions) * config.prompts * (1 + len(config.alphas) * len(config.gammas))


def run_synthetic(config: SyntheticConfig, out: Path, progress: Progress | None = None) -> dict:
    from specdec.bench.suite import machine_description

    results = [measure_precision(config, precision, progress) for precision in config.precisions]
    payload = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_description(),
        "config": {**asdict(config), "target": asdict(config.target), "draft": asdict(config.draft)},
        "precisions": results,
    }
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "synthetic.json", payload)
    (out / "synthetic.md").write_text(synthetic_markdown(payload))
    plot_synthetic(payload, out / "synthetic.png")
    payload["markdown"] = (out / "synthetic.md").read_text()
    return payload


def synthetic_markdown(payload: dict) -> str:
    config = payload["config"]
    lines = [
        f"# specdec bench --synthetic, {payload['date']}",
        "",
        f"machine: {payload['machine']}; {config['prompts']} random prompts of {config['prompt_tokens']} tokens, "
        f"{config['max_new_tokens']} new tokens each, greedy; speedups are decode time (prefill excluded) "
        "against target-only decoding in the same run.",
        "",
    ]
    for result in payload["precisions"]:
        forward = result["target_forward_ms"]
        lines += [
            f"## {result['precision']}: target {result['target_parameters'] / 1e6:.1f}M, "
            f"draft {result['draft_parameters'] / 1e6:.1f}M parameters",
            "",
            "- target forward T(k), ms: "
            + ", ".join(f"T({k}) {v:.1f}" for k, v in forward.items())
            + "; T(k)/T(1): "
            + ", ".join(f"{v / forward['1']:.2f}" for v in forward.values()),
            f"- draft forward {result['draft_forward_ms']:.2f} ms, c = {result['c']:.3f}",
            f"- target-only: {result['target_only_ms_per_token']:.1f} ms/token "
            f"({result['target_only_tokens_per_second']:.1f} tok/s); bandwidth bound "
            f"{result['bandwidth_bound_ms_per_token']:.1f} ms/token = "
            f"{result['streamed_weight_bytes'] / 1e6:.0f} MB streamed weights / "
            f"{max(result['bandwidth_bytes_per_second'].values()) / 1e9:.1f} GB/s "
            f"(read {result['bandwidth_bytes_per_second']['read'] / 1e9:.1f}, "
            f"copy {result['bandwidth_bytes_per_second']['copy'] / 1e9:.1f}); measured / bound = "
            f"{result['target_only_ms_per_token'] / result['bandwidth_bound_ms_per_token']:.2f}",
            "",
            "| alpha | gamma | acceptance at position 1 | accepted / drafted | tau | tokens/s | measured speedup | Leviathan prediction | measured / predicted |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for run in result["runs"]:
            lines.append(
                f"| {run['alpha']} | {run['gamma']} | {run['first_position_acceptance']:.3f} | {run['accepted_per_drafted']:.3f} | {run['tau']:.2f} | "
                f"{run['tokens_per_second']:.1f} | {run['measured_speedup']:.2f}x | "
                f"{run['predicted_speedup']:.2f}x | {run['measured_speedup'] / run['predicted_speedup']:.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot_synthetic(payload: dict, path: Path) -> None:
    """Measured (solid) vs predicted (dashed) speedup against alpha, one line per gamma and precision."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = payload["precisions"]
    figure, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.2), squeeze=False)
    for axis, result in zip(axes[0], results, strict=True):
        gammas = sorted({run["gamma"] for run in result["runs"]})
        for index, gamma in enumerate(gammas):
            runs = [run for run in result["runs"] if run["gamma"] == gamma]
            colour = f"C{index}"
            for kind, style in (("measured", "o-"), ("predicted", "x--")):
                axis.plot([r["alpha"] for r in runs], [r[f"{kind}_speedup"] for r in runs], style, color=colour,
                          label=f"gamma {gamma} {kind}")
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_xlabel("alpha (per-token acceptance)")
        axis.set_ylabel("speedup over target-only")
        axis.set_title(
            f"{result['precision']}: {result['target_parameters'] / 1e6:.0f}M target, c = {result['c']:.2f}",
            fontsize=10,
        )
        axis.legend(fontsize=7)
    figure.suptitle(f"specdec bench --synthetic, {payload['date'][:10]}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
