"""Memory said before it is needed: a model that would not fit in this machine's available memory
in the asked precision is refused up front, with one line naming the size it needs and a way that
fits, never left to an out-of-memory kill halfway through a load.

The figures are estimates from the config (parameters by kind, bytes a parameter in each precision,
as packed: int4's 4.625 bits with its group and super-block scales, w8a32's 10, int8's 8), with a margin for the
runtime; a packed model read from disk needs only its packed bytes, packing it the first time also
one part's float32 weights (the output head, usually the largest)."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.machine import available_memory

# Bytes a weight of a linear takes in each precision, scales included (int4: 4-bit q, float16 scale
# and min per 32 inputs; w8a32: 8-bit q, float32 scale and min per 32; int8: a scale per row).
LINEAR_BYTES = {None: 4.0, "int4": 0.578125, "w8a32": 1.25, "int8": 1.0}
RUNTIME_BYTES = 600 << 20  # torch, the tokenizer and the first forward's scratch, measured ~0.5 GB
MARGIN = 1.1


@dataclass(frozen=True)
class ModelSize:
    linear_parameters: int  # every linear's weights, the output head's included
    embedding_parameters: int  # the input embedding (float32 in every precision)
    largest_part_parameters: int  # the largest part read at once while packing: a layer or the head
    tied: bool = False  # the head is the embedding (in floats: one copy; packed: a packed copy of its own)

    @classmethod
    def of(cls, hf_config) -> ModelSize:
        """From a config alone (transformers' field names; no weights read)."""
        hidden = hf_config.hidden_size
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        intermediate = getattr(hf_config, "intermediate_size", None) or 4 * hidden
        layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * intermediate
        head = hf_config.vocab_size * hidden
        return cls(hf_config.num_hidden_layers * layer + head, head, max(layer, head),
                   bool(getattr(hf_config, "tie_word_embeddings", False)))

    def bytes_needed(self, quantize: str | None, dtype_bytes: int = 4, packing: bool = False) -> int:
        """Resident bytes to run the model in ``quantize`` (None: floats of ``dtype_bytes``), and
        while ``packing`` it the first time."""
        linear = LINEAR_BYTES[quantize] if quantize else dtype_bytes
        shared = self.embedding_parameters if self.tied and not quantize else 0
        embedding = self.embedding_parameters * (4 if quantize else dtype_bytes)
        total = (self.linear_parameters - shared) * linear + embedding
        if quantize and packing:
            total += self.largest_part_parameters * 4 * 2  # its float32 weights and the packing's temporaries
        return int(total * MARGIN) + RUNTIME_BYTES


class WontFit(ValueError):
    """A model that would not fit in the memory available, said before any weight is read."""


def check_fits(name: str, size: ModelSize, quantize: str | None, dtype_bytes: int = 4, packing: bool = False,
               available: int | None = None) -> None:
    """Raise WontFit naming what ``name`` needs in ``quantize`` and a precision that fits, where the
    memory available (``available``: measured when None) is short."""
    available = available_memory() if available is None else available
    needed = size.bytes_needed(quantize, dtype_bytes, packing)
    if available is None or needed <= available:
        return
    what = quantize or {2: "16-bit floats", 4: "float32", 8: "float64"}.get(dtype_bytes, "floats")
    fitting = [candidate for candidate in ("int4", "w8a32", "int8")
               if candidate != quantize and size.bytes_needed(candidate, packing=True) <= available]
    way = (f"--quantize {fitting[0]} needs ~{_gib(size.bytes_needed(fitting[0], packing=True))}" if fitting else
           "no precision fits here: a machine with more memory, or a smaller model")
    raise WontFit(f"{name} in {what} needs ~{_gib(needed)} of memory{' while packing' if packing else ''}, "
                  f"and {_gib(available)} is available: {way}")


def _gib(count: int) -> str:
    return f"{count / 2**30:.1f} GiB"
