"""Logits -> probabilities, identically for the target (p) and the drafter (q).

Speculative sampling is lossless with respect to the *processed* target distribution, so the
same temperature / top-k / top-p / min-p must be applied on both sides (Leviathan et al. 2023).
Temperature 0 means greedy decoding: verification then compares argmaxes and needs no q.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from specdec.constraint import Constraint

from specdec.core.acceptance import EXACT, canonical_acceptance
from specdec.names import SAMPLING_RULES

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the target, and the most likely alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), most likely first


def token_logprobs(
    logits: torch.Tensor,  # [k, vocab]: the target's logits that predicted each token
    tokens: torch.Tensor,  # [k] int64
    top: int,
) -> list[TokenLogprob]:
    """The target's own log-probabilities (log-softmax of its raw logits, before temperature,
    top-k/p and grammar masks, as vLLM reports by default). Taken from the verify forward, whose
    rows score each token as it would be scored alone: exact, whatever was drafted."""
    import torch  # here, as logits_to_probs

    logprobs = torch.log_softmax(logits.double(), dim=-1)  # [k, vocab]
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0].tolist()
    best = logprobs.topk(top, dim=-1) if top else None
    return [TokenLogprob(token, value, () if best is None else
                         tuple(zip(best.indices[row].tolist(), best.values[row].tolist(), strict=True)))
            for row, (token, value) in enumerate(zip(tokens.tolist(), chosen, strict=True))]


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks for, defined once for the API, the CLI, the bench and the server:
    how logits become a next-token distribution (temperature == 0 is greedy), the request's
    seed, and when to stop."""

    temperature: float = 0.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1.0 disables
    min_p: float = 0.0  # 0.0 disables
    seed: int | None = None  # None: a fresh random seed per request
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()  # stop strings (not included in the output)
    # How a sampled request draws and verifies (specdec.core.rules): "coupled" (the same seed gives the
    # target-alone text under any drafter, policy or batch) or "rejection" (the best acceptance).
    # None: coupled when a seed is given, rejection otherwise (docs/sampling.md).
    sampling_rule: str | None = None
    # What the output must match (a JSON schema, a regex, a grammar; specdec.constraint): p is
    # masked to the tokens it allows, before temperature and the rest. None: free text.
    constraint: Constraint | None = None
    # Log-probabilities of each generated token under the target, with this many most likely
    # alternatives (0: the token's alone; None: none asked for). See token_logprobs.
    logprobs: int | None = None
    # Which drafts verification keeps (specdec.core.acceptance): "exact" (lossless, the default), or LOSSY
    # "lossy" / "topk:k=3,delta=0.5" / "typical:epsilon=0.09,alpha=0.3", held in its canonical spelling.
    acceptance: str = EXACT
    # The output the client expects (OpenAI's predicted outputs: an edited file's current text):
    # text, which the text layer encodes, or token ids, which a prediction drafter copies
    # (specdec.drafting.prediction). It changes speed, never the output. None: no prediction.
    prediction: str | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.prediction, list):
            object.__setattr__(self, "prediction", tuple(int(token) for token in self.prediction))
        if isinstance(self.stop, str):  # a single stop string
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        if self.sampling_rule not in (None, *SAMPLING_RULES):
            raise ValueError(f"sampling_rule must be one of {', '.join(SAMPLING_RULES)}, got {self.sampling_rule!r}")
        object.__setattr__(self, "acceptance", canonical_acceptance(self.acceptance))

    @property
    def lossy(self) -> bool:
        """Whether verification may keep drafts the exact rule rejects (the output's law is then not p)."""
        return self.acceptance != EXACT

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def rule(self) -> str:
        """The sampling rule this request runs (the default resolved)."""
        if self.sampling_rule is not None:
            return self.sampling_rule
        return "coupled" if self.seed is not None else "rejection"


def logits_to_probs(
    logits: torch.Tensor,  # [n, vocab]
    params: SamplingParams,
) -> torch.Tensor:  # [n, vocab] float32, rows sum to 1
    """Apply temperature, top-k, top-p and min-p (in that order, as transformers does)."""
    import torch  # here, so that SamplingParams checks a command line's options before torch loads

    if params.greedy:
        # The limit of temperature -> 0: a point mass on the argmax.
        probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        return probs.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    scores = logits.float() / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth_best = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(-1)
        # Keep the smallest set whose mass reaches top_p: drop a token when the mass strictly
        # before it already reaches top_p. The best token is always kept.
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    probs = scores.softmax(-1)
    if params.min_p > 0.0:
        threshold = params.min_p * probs.max(-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
