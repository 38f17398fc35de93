"""specdec: lossless speculative decoding for Hugging Face-format causal language models."""

from specdec.decoder import GenerationResult, SpeculativeDecoder, StreamChunk
from specdec.drafting import (Draft, Drafter, MergedDrafter, ModelDrafter, ModelTreeDrafter, NGramDrafter, StagedDrafter,
                              make_drafter)
from specdec.engine import Engine, Request, TokenSource
from specdec.metrics import SpecStats
from specdec.models import Attention, ForwardOutput, LanguageModel, load
from specdec.policy import CostModelPolicy, FixedPolicy, HeuristicPolicy, ThresholdPolicy, make_policy
from specdec.sampling import SamplingParams, logits_to_probs
from specdec.verify import greedy_tree_verify, greedy_verify, rejection_sample, tree_rejection_sample

__version__ = "0.1.0"
__all__ = [
    "Attention", "Engine", "ForwardOutput", "Request", "CostModelPolicy", "Draft", "Drafter", "FixedPolicy", "HeuristicPolicy", "NGramDrafter", "StagedDrafter",
    "ThresholdPolicy", "make_drafter", "make_policy", "GenerationResult", "LanguageModel", "ModelDrafter", "SamplingParams", "SpecStats",
    "SpeculativeDecoder", "StreamChunk", "TokenSource", "greedy_verify", "load", "logits_to_probs",
    "rejection_sample", "greedy_tree_verify", "tree_rejection_sample", "MergedDrafter", "ModelTreeDrafter",
]
