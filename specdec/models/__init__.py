from specdec.models.base import Cache, LanguageModel, Network
from specdec.models.cache import KVCache
from specdec.models.loading import load

__all__ = ["Cache", "KVCache", "LanguageModel", "Network", "load"]
