"""specdec: lossless speculative decoding for Hugging Face-format causal language models.

The public names load on first use (PEP 562), so that `import specdec.commands.cli` and `specdec --help`
do not import torch; `from specdec import SpeculativeDecoder, load` works as usual."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "specdec.constraint": ("Constraint",),
    "specdec.decoder": ("GenerationResult", "SpeculativeDecoder", "StreamChunk"),
    "specdec.drafting": ("Draft", "Drafter", "MergedDrafter", "ModelDrafter", "ModelTreeDrafter", "NGramDrafter",
                         "StagedDrafter", "make_drafter"),
    "specdec.core.engine": ("Engine", "Request"),
    "specdec.core.metrics": ("SpecStats",),
    "specdec.models": ("Attention", "ForwardOutput", "LanguageModel", "load"),
    "specdec.core.policy": ("CostModelPolicy", "FixedPolicy", "HeuristicPolicy", "ThresholdPolicy", "make_policy"),
    "specdec.core.sampling": ("SamplingParams", "logits_to_probs"),
    "specdec.text": ("TokenSource",),
    "specdec.core.verify": ("greedy_tree_verify", "greedy_verify", "rejection_sample", "tree_rejection_sample"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:  # what type checkers and editors see
    from specdec.core.engine import Engine, Request  # noqa: F401
    from specdec.core.metrics import SpecStats  # noqa: F401
    from specdec.core.policy import CostModelPolicy, FixedPolicy, HeuristicPolicy, ThresholdPolicy, make_policy  # noqa: F401
    from specdec.core.sampling import SamplingParams, logits_to_probs  # noqa: F401
    from specdec.core.verify import greedy_tree_verify, greedy_verify, rejection_sample, tree_rejection_sample  # noqa: F401
    from specdec.decoder import GenerationResult, SpeculativeDecoder, StreamChunk  # noqa: F401
    from specdec.drafting import (  # noqa: F401
        Draft,
        Drafter,
        MergedDrafter,
        ModelDrafter,
        ModelTreeDrafter,
        NGramDrafter,
        StagedDrafter,
        make_drafter,
    )
    from specdec.models import Attention, ForwardOutput, LanguageModel, load  # noqa: F401
    from specdec.text import TokenSource  # noqa: F401
