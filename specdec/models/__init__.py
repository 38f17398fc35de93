from specdec.models.base import Attention, Cache, ForwardOutput, LanguageModel, Network, Segment
from specdec.models.cache import KVCache
from specdec.models.loading import load

__all__ = ["Attention", "Cache", "ForwardOutput", "Segment", "KVCache", "LanguageModel", "Network", "load"]
