"""Opt-in LOSSY acceptance: a drafted token that the exact rule turns down may still be kept when
the target finds it plausible enough (p = target, q = draft, as in Leviathan et al. 2023).

Exact acceptance (``"exact"``) is the default everywhere and runs the lossless verifiers as they
are. Any other setting changes the output's law; it is asked for by name (``--acceptance``,
``SamplingParams(acceptance=...)``, a server request's ``"acceptance"``) and every result says so
(docs/acceptance.md). Two published schemes, each a set R(p) of tokens the target's distribution
p at a drafted position admits:

- ``topk:k=K,delta=D``, relaxed top-k (SGLang's ``--speculative-accept-threshold-*``,
  TensorRT-LLM's relaxed acceptance): x is in R when fewer than K other tokens are at least as
  likely under p, and p(x) > D * max p.
- ``typical:epsilon=E,alpha=A``, typical acceptance (Medusa; vLLM V0's TypicalAcceptanceSampler):
  x is in R when p(x) > min(E, A * exp(-H(p))), H the entropy of p: the more the target hesitates,
  the lower the bar.

The rule, one for greedy decoding, rejection sampling and the coupled rule, chains and trees
(``Relaxation``, which every verifier in specdec.core.verify takes): a drafted token is accepted when the
exact test accepts it, or else when it is in R. Where both turn it down, the step ends with the
token the exact rule emits there (greedy: the argmax; rejection: a draw of norm(max(0, p - q));
coupled: the target's draw), so with R empty the step is the exact step, draw for draw. p is the
distribution sampling uses (temperature, top-k/p, min-p, a grammar's mask); under greedy decoding,
where that is a point mass, R reads softmax(logits) at temperature 1 (after a grammar's mask).

This module imports no torch until a tensor function runs: SamplingParams checks a command line's
--acceptance with parse_acceptance before the models (and torch) load.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

EXACT = "exact"
LOSSY = "lossy"  # the one recommended preset's name
# name -> (parameter -> (default, is an integer, least, most)); the defaults are the scheme's alone
SCHEMES: dict[str, dict[str, tuple[float, bool, float, float]]] = {
    "topk": {"k": (3, True, 1, math.inf), "delta": (0.5, False, 0.0, 1.0)},
    # vLLM's and Medusa's defaults: posterior threshold 0.09, alpha its square root
    "typical": {"epsilon": (0.09, False, 0.0, 1.0), "alpha": (0.3, False, 0.0, math.inf)},
}
# The target's top 3, each at least half as likely as its top-1: of the settings measured on
# HumanEval it drifts least, and none bought speed there (docs/acceptance.md, "Drift, measured").
LOSSY_PRESET = "topk:k=3,delta=0.5"
SYNTAX = "exact | lossy | topk[:k=K,delta=D] | typical[:epsilon=E,alpha=A]"


@dataclass(frozen=True)
class Acceptance:
    """A parsed --acceptance: ``scheme`` ("exact" or one of SCHEMES) and its parameters, all set."""

    scheme: str
    params: tuple[tuple[str, float], ...] = ()

    @property
    def exact(self) -> bool:
        return self.scheme == EXACT

    def param(self, name: str) -> float:
        return dict(self.params)[name]

    def __str__(self) -> str:
        """The canonical spelling, what results are marked with: ``topk:k=3,delta=0.5``."""
        if self.exact:
            return EXACT
        return f"{self.scheme}:" + ",".join(f"{name}={value:g}" for name, value in self.params)

    def admits(
        self,
        probs: torch.Tensor,  # [n, vocab]: the target's distribution where each token was drafted
        tokens: torch.Tensor,  # [n] int64
    ) -> torch.Tensor:  # [n] bool: token i is in R(probs[i])
        """Whether each token is in the scheme's relaxed set R (all False for exact)."""
        import torch

        p_x = probs.gather(-1, tokens[:, None])  # [n, 1]
        if self.scheme == "topk":
            # rank = the other tokens at least as likely: a tie counts against x, so that with k = 1 only
            # a strict maximum of p is admitted, which is also the argmax of the logits (the greedy pick)
            rank = (probs >= p_x).sum(-1) - 1
            return (rank < self.param("k")) & (p_x[:, 0] > self.param("delta") * probs.max(-1).values)
        if self.scheme == "typical":
            entropy = torch.special.entr(probs.double()).sum(-1)  # 0 log 0 = 0
            bar = torch.clamp(self.param("alpha") * torch.exp(-entropy), max=self.param("epsilon"))
            return p_x[:, 0].double() > bar
        return torch.zeros(tokens.shape, dtype=torch.bool, device=tokens.device)


def number(text: str, name: str, integer: bool) -> float:
    try:
        return int(text) if integer else float(text)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise ValueError(f"acceptance parameter {name} must be {kind}, got {text!r}") from None


@functools.lru_cache(maxsize=64)  # verification looks a request's setting up every step
def parse_acceptance(text: str) -> Acceptance:
    """``exact``, ``lossy`` (LOSSY_PRESET), or ``SCHEME[:name=value,...]`` with the scheme's
    defaults for parameters left out; ValueError naming what is wrong."""
    spec = text.strip()
    if spec in ("", EXACT):
        return Acceptance(EXACT)
    if spec == LOSSY:
        spec = LOSSY_PRESET
    scheme, _, rest = spec.partition(":")
    if scheme not in SCHEMES:
        raise ValueError(f"unknown acceptance {text!r}; use {SYNTAX}")
    given: dict[str, float] = {}
    for item in filter(None, (piece.strip() for piece in rest.split(","))):
        key, equals, written = (part.strip() for part in item.partition("="))
        if not equals or key not in SCHEMES[scheme]:
            raise ValueError(f"{scheme} takes {', '.join(f'{n}=...' for n in SCHEMES[scheme])}; got {item!r}")
        given[key] = number(written, key, SCHEMES[scheme][key][1])
    params = []
    for name, (default, _, least, most) in SCHEMES[scheme].items():
        value = given.get(name, default)
        if not least <= value <= most:  # NaN fails too
            raise ValueError(f"{scheme}'s {name} must be in [{least:g}, {most:g}], got {value:g}")
        params.append((name, value))
    return Acceptance(scheme, tuple(params))


def canonical_acceptance(text: str) -> str:
    """The spelling results are marked with (``lossy`` resolved to its preset, defaults filled in)."""
    return str(parse_acceptance(text))


@dataclass
class Relaxation:
    """The relaxed rule on one step's draft: which drafted nodes R admits and how likely the target
    finds each; the verifier records in ``used`` the accepted nodes that only R accepted."""

    admitted: list[bool]  # [nodes]: node i's token is in R at its parent's row of p
    scores: list[float]  # [nodes]: p(node i's token) at that row
    used: list[int] = field(default_factory=list)

    @staticmethod
    def of(
        acceptance: Acceptance,
        probs: torch.Tensor,  # [nodes + 1, vocab]: p after the last context token, then after each node
        tokens: torch.Tensor,  # [nodes] int64
        parents: Sequence[int] | None,  # a tree's parents (-1: the root); None for a chain
    ) -> Relaxation:
        rows = list(range(tokens.shape[0])) if parents is None else [parent + 1 for parent in parents]
        at_nodes = probs[rows]  # [nodes, vocab]: p where each node was drafted
        return Relaxation(acceptance.admits(at_nodes, tokens).tolist(),
                          at_nodes.gather(-1, tokens[:, None])[:, 0].tolist())

    def fallback(self, children: Sequence[int]) -> int | None:
        """A node (of a tree, or a chain's: one child) whose children the exact test all turned
        down: the admitted child the target finds most likely (the first on ties), or None."""
        admitted = [child for child in children if self.admitted[child]]
        if not admitted:
            return None
        chosen = max(admitted, key=lambda child: self.scores[child])
        self.used.append(chosen)
        return chosen


def relaxation_for(
    acceptance: Acceptance,
    probs: torch.Tensor,  # [nodes + 1, vocab]: the distribution R reads (module docstring)
    tokens: torch.Tensor,  # [nodes] int64
    parents: Sequence[int] | None,
) -> Relaxation | None:
    """The step's Relaxation, or None under exact acceptance (the verifiers then run unchanged)."""
    return None if acceptance.exact else Relaxation.of(acceptance, probs, tokens, parents)
