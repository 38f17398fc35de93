"""GGUF models on llama.cpp's kernels (ggml) through llama-cpp-python's low-level API, behind
specdec's Network interface. Needs ``pip install "specdec[llama-cpp]"``.

One llama.cpp context per loaded model holds one KV pool shared by up to ``max_sequences``
sequences (a unified KV cache). A ``LlamaCppCache`` leases one sequence id per row and gives it
back when the cache is garbage-collected. A forward is one ``llama_decode`` over every segment's
tokens, each token with its explicit position and its row's sequence id, and logits for every
token. As with the other caches, a forward commits nothing: the entries past a row's committed
length are removed (``llama_memory_seq_rm``) before that row's next forward or on rollback.

While two or more sequences are leased, removed entries are parked, not freed: their cells move to a
parking sequence that is never attended, and are freed when no leased sequence holds a cell.
llama.cpp's slot search restarts at the first freed cell (``llama_kv_cache::seq_rm`` moves its head
back) and takes cells one by one, so a freed hole lets a row's next token land before that row's
older cells; attention then sums the keys in another order than a chain does (measured: 0.56 off in
a logit on SmolLM2 Q4_1). With one sequence, the freed cells are its own suffix, which its next
tokens refill in order: freed at once.

Token trees (one forward, written = 0): every branch is a sequence (the row's own for the first,
leased ones for the rest, each given the row's context by ``llama_memory_seq_cp``), and a node is
in the sequences of every branch below it (a seq-id set in the batch), so it attends to the
context, its ancestors and itself. ``compact`` parks every cell of the tree, then gives the row
the accepted path (copied from a branch through its last node) and drops the leased branches:
the rejected siblings' cells stay occupied, so the row's next token lands after them.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specdec.models.base import Attention, ForwardOutput, LanguageModel, check_forward


def import_llama_cpp():
    try:
        import llama_cpp
    except ImportError as error:
        raise ValueError(
            'the llama.cpp backend needs llama-cpp-python: pip install "specdec[llama-cpp]" '
            "(it builds llama.cpp from source, 5-10 minutes on 2 cores)"
        ) from error
    return llama_cpp


class LlamaCppTokenizer:
    """The GGUF's own tokenizer (llama.cpp's), with the two calls the text layer makes."""

    chat_template = None  # GGUF templates are not applied here; chat falls back to plain lines

    def __init__(self, lib, vocab) -> None:
        self.lib, self.vocab = lib, vocab

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 16
        buffer = (self.lib.llama_token * capacity)()
        count = self.lib.llama_tokenize(self.vocab, data, len(data), buffer, capacity, add_special_tokens, False)
        if count < 0:  # the buffer was too small: -count tokens are needed
            capacity = -count
            buffer = (self.lib.llama_token * capacity)()
            count = self.lib.llama_tokenize(self.vocab, data, len(data), buffer, capacity, add_special_tokens, False)
        return list(buffer[:count])

    def get_vocab(self) -> dict[str, int]:
        """Token text -> id, as transformers' tokenizers give it (GGUF stores the same texts)."""
        count = self.lib.llama_vocab_n_tokens(self.vocab)
        texts = (self.lib.llama_vocab_get_text(self.vocab, token) for token in range(count))
        return {text.decode("utf-8", errors="replace"): token for token, text in enumerate(texts)}

    def decode(
        self, ids: Sequence[int], skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False
    ) -> str:  # llama.cpp never cleans up spaces
        if not ids:
            return ""
        tokens = (self.lib.llama_token * len(ids))(*ids)
        capacity = 16 * len(ids) + 64
        text = ctypes.create_string_buffer(capacity)
        count = self.lib.llama_detokenize(self.vocab, tokens, len(ids), text, capacity, skip_special_tokens, False)
        if count < 0:
            capacity = -count
            text = ctypes.create_string_buffer(capacity)
            count = self.lib.llama_detokenize(self.vocab, tokens, len(ids), text, capacity, skip_special_tokens, False)
        return text.raw[:count].decode("utf-8", errors="replace")


class LlamaCppCache:
    """Rows = sequence ids of the network's context; the Cache verbs on top of them."""

    def __init__(self, network: LlamaCppNetwork, max_length: int, rows: int) -> None:
        self.network, self.max_length, self.rows = network, max_length, rows
        self.seq_ids = network.lease(rows)
        self.lengths = [0] * rows
        self.stored = [0] * rows  # entries in the KV pool, committed or not
        self.trees: dict[int, TreeBranches] = {}  # rows whose uncommitted entries are a token tree
        # The trees' leased branches too (a forward that failed leaves its tree unsettled).
        weakref.finalize(self, give_back_all, network, list(self.seq_ids), self.trees)

    def reserve(self, capacity: int) -> None:
        """The KV pool is allocated with the context."""

    def ensure(self, row: int, length: int) -> None:
        """Nothing to take: see reserve."""

    def crop(self, row: int) -> None:
        """Forget the row's uncommitted entries."""
        if row in self.trees:
            self.settle_tree(row, [])
        elif self.stored[row] > self.lengths[row]:
            self.network.remove(self.seq_ids[row], self.lengths[row])
            self.stored[row] = self.lengths[row]

    def commit(self, row: int, count: int) -> None:
        self.lengths[row] += count

    def rollback(self, row: int, length: int) -> None:
        self.lengths[row] = min(self.lengths[row], length)
        self.crop(row)

    def compact(self, row: int, keep: Sequence[int]) -> None:
        """Keep the written nodes ``keep`` (an accepted tree path, or a chain's prefix) and commit them."""
        if row in self.trees:
            self.settle_tree(row, list(keep))
        elif list(keep) != list(range(len(keep))):
            raise ValueError(f"compact of a chain keeps a prefix, got {list(keep)}")
        self.commit(row, len(keep))

    def start_tree(self, row: int, parents: Sequence[int]) -> list[list[int]]:
        """Lease a sequence per extra branch of a tree written after the row's committed context;
        each node's sequence ids (its own branch's first)."""
        branching, continued = [], set()
        for parent in parents:  # a node continues its parent's branch unless a sibling already does
            branching.append(parent in continued)
            continued.add(parent)
        own, extra = self.seq_ids[row], self.network.lease(sum(branching))
        for seq_id in extra:  # a new branch sees the row's committed context
            self.network.lib.llama_memory_seq_cp(self.network.memory, own, seq_id, 0, -1)
        leased, homes = iter(extra), []
        for node, parent in enumerate(parents):
            homes.append(next(leased) if branching[node] else homes[parent] if parent >= 0 else own)
        seq_sets = [[home] for home in homes]
        for node in range(len(parents) - 1, 0, -1):  # children come after their parents
            if parents[node] >= 0:
                seq_sets[parents[node]] += [s for s in seq_sets[node] if s not in seq_sets[parents[node]]]
        self.trees[row] = TreeBranches(extra, [ids[0] for ids in seq_sets])
        return seq_sets

    def settle_tree(self, row: int, keep: list[int]) -> None:
        """Park every cell of the row's tree, give the row the nodes ``keep`` (a path from a root),
        and give the leased branches back."""
        tree, network, own, start = self.trees.pop(row), self.network, self.seq_ids[row], self.lengths[row]
        lib, memory = network.lib, network.memory
        for seq_id in (own, *tree.extra):
            lib.llama_memory_seq_cp(memory, seq_id, network.parking, start, -1)
        branch = tree.branch_of[keep[-1]] if keep else own
        if branch == own:  # the path is the row's own branch: drop what lies past it
            lib.llama_memory_seq_rm(memory, own, start + len(keep), -1)
        else:
            lib.llama_memory_seq_rm(memory, own, start, -1)
            lib.llama_memory_seq_cp(memory, branch, own, start, start + len(keep))
        for seq_id in tree.extra:
            lib.llama_memory_seq_rm(memory, seq_id, 0, -1)
        network.give_back(tree.extra)
        self.stored[row] = start + len(keep)


def give_back_all(network: LlamaCppNetwork, seq_ids: list[int], trees: dict[int, TreeBranches]) -> None:
    network.give_back([seq_id for tree in trees.values() for seq_id in tree.extra] + seq_ids)


@dataclass
class TreeBranches:
    extra: list[int]  # the sequences leased for the branches after the first
    branch_of: list[int]  # each node's own branch (a sequence whose path runs through it)


# ggml scores a block of 8 or more rows with other kernels than one row, so such a block's
# logits differ from each token's alone (measured: docs/llama-cpp.md, "Exactness: two settings decide it"); longer
# verify blocks are split into calls of this many tokens.
EXACT_ROWS = 7

# The KV cache in bfloat16, not llama.cpp's default float16: with an f16 (or f32) cache ggml's CPU
# flash attention has two more paths, a one-token call over 512+ cells splitting the keys across
# threads and a call of 64+ tokens in tiles, each summing in another order than the plain path; a
# token then scores differently alone (one token) than in a verify block, or depending on where
# another row's cells sit (measured: 1.88 off in a logit on SmolLM2 Q4_1). With bf16 keys and
# values every call takes the plain path, which sums each query's keys one by one in cell order.
KV_TYPE = 30  # GGML_TYPE_BF16


def exact_calls(segments: Sequence[tuple[int, int]], batch_size: int) -> list[tuple[int, int]]:
    """How a forward's flattened tokens go into llama_decode calls so that each is scored as in a
    forward of its row alone; segments: (tokens, the row's cached length) in order. ggml scores a
    call of 8 or more tokens with other kernels than fewer, so after a row's prefill its tokens go
    in calls of at most EXACT_ROWS, packed with other such rows' (per-row kernels: neighbours do
    not matter); a row with nothing cached yet (a prompt) gets calls of its own, as alone."""
    calls: list[tuple[int, int]] = []
    packed_from = None  # start of the call being packed with rows past their prefill
    offset = 0
    for count, cached in segments:
        if cached == 0:
            if packed_from is not None and packed_from < offset:
                calls.append((packed_from, offset))
            calls += [(start, min(start + batch_size, offset + count)) for start in range(offset, offset + count,
                                                                                            batch_size)]
            packed_from = None
        else:
            packed_from = offset if packed_from is None else packed_from
            for end in range(offset + 1, offset + count + 1):
                if end - packed_from == min(EXACT_ROWS, batch_size):
                    calls.append((packed_from, end))
                    packed_from = end
        offset += count
    if packed_from is not None and packed_from < offset:
        calls.append((packed_from, offset))
    return calls


class LlamaCppNetwork:
    def __init__(
        self, lib, model, context_size: int, max_sequences: int, batch_size: int, threads: int, flash_attention: bool
    ) -> None:
        self.lib, self.model = lib, model
        params = lib.llama_context_default_params()
        # Explicit, not llama.cpp's "auto": the choice changes the logits' last bits, and greedy
        # output must equal llama.cpp's own under the same setting.
        params.flash_attn_type = 1 if flash_attention else 0
        params.type_k = params.type_v = KV_TYPE
        params.n_ctx, params.n_batch, params.n_ubatch = context_size, batch_size, batch_size
        # one more sequence than can be leased: the parking sequence (see the module docstring)
        params.n_seq_max, params.kv_unified, params.no_perf = max_sequences + 1, True, True
        params.n_threads = params.n_threads_batch = threads
        self.context = lib.llama_init_from_model(model, params)
        if not self.context:
            raise ValueError(f"llama.cpp could not create a context of {context_size} tokens")
        self.memory = lib.llama_get_memory(self.context)
        self.vocab_size = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
        self.batch_size = batch_size
        self.batch = lib.llama_batch_init(batch_size, 0, max_sequences)  # a tree node: up to one id per branch
        self.max_sequences, self.parking = max_sequences, max_sequences
        self.free_ids = list(range(max_sequences))

    def __del__(self) -> None:
        lib = getattr(self, "lib", None)
        if lib is not None and getattr(self, "context", None):
            lib.llama_batch_free(self.batch)
            lib.llama_free(self.context)
            lib.llama_model_free(self.model)

    def lease(self, rows: int) -> list[int]:
        if rows > len(self.free_ids):
            raise RuntimeError(
                f"{rows} llama.cpp sequences needed, {len(self.free_ids)} free; load the model with more max_sequences"
            )
        leased, self.free_ids = self.free_ids[:rows], self.free_ids[rows:]
        for seq_id in leased:
            self.remove(seq_id, 0)
        return leased

    def give_back(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:  # remove(.., 0) frees the parked cells once every leased sequence is empty
            self.remove(seq_id, 0)
        self.free_ids += seq_ids

    def remove(self, seq_id: int, start: int) -> None:
        """Drop sequence seq_id's entries at positions >= start (parking their cells if others are leased)."""
        if len(self.free_ids) < self.max_sequences - 1:
            self.lib.llama_memory_seq_cp(self.memory, seq_id, self.parking, start, -1)
        self.lib.llama_memory_seq_rm(self.memory, seq_id, start, -1)
        if start == 0:
            self.free_parking_if_idle()

    def free_parking_if_idle(self) -> None:
        """Free the parked cells once no sequence holds a cell: no live cell lies after a hole then.
        (A server keeps its rows leased for its whole life and resets finished rows to 0: this is
        where their parked cells go, whenever every row is empty at once.)"""
        if self.lib.llama_memory_seq_pos_max(self.memory, self.parking) < 0:
            return
        free = set(self.free_ids)
        leased = (seq_id for seq_id in range(self.max_sequences) if seq_id not in free)
        if all(self.lib.llama_memory_seq_pos_max(self.memory, seq_id) < 0 for seq_id in leased):
            self.lib.llama_memory_seq_rm(self.memory, self.parking, 0, -1)

    def new_cache(self, max_length: int, rows: int = 1) -> LlamaCppCache:
        return LlamaCppCache(self, max_length, rows)

    def __call__(
        self,
        tokens: torch.Tensor,  # [n] int64
        positions: torch.Tensor,  # [n] int64
        cache: LlamaCppCache,
        attention: Attention,
        want_logits: bool = True,
        hidden_layers: tuple[int, ...] = (),
    ) -> ForwardOutput:  # logits [n, vocab] float32
        check_forward(tokens, positions, cache, attention)
        if hidden_layers:
            raise ValueError(
                "the llama.cpp backend gives no hidden states (drafters that need them run on specdec's forward)"
            )
        if any(segment.written for segment in attention.segments):
            raise ValueError(
                "the llama.cpp backend scores a token tree in one forward; a tree grown over several "
                "(the tree drafter's draft model) runs with --backend specdec"
            )
        seq_ids = []
        for segment in attention.segments:
            cache.crop(segment.row)
            if segment.parents is None:
                seq_ids += [[cache.seq_ids[segment.row]]] * segment.count
            else:
                seq_ids += cache.start_tree(segment.row, segment.parents)
        token_list, position_list = tokens.tolist(), positions.tolist()
        if attention.batch_invariant:
            calls = exact_calls([(segment.count, cache.lengths[segment.row]) for segment in attention.segments],
                                self.batch_size)
        else:
            calls = [(start, min(start + self.batch_size, len(token_list)))
                     for start in range(0, len(token_list), self.batch_size)]
        logits = []
        try:
            for start, end in calls:
                logits.append(
                    self.decode(token_list[start:end], position_list[start:end], seq_ids[start:end], want_logits)
                )
        finally:  # on an error too: what was written is uncommitted, and crop (or the next forward) drops it
            for segment in attention.segments:
                cache.stored[segment.row] = cache.lengths[segment.row] + segment.count
        return ForwardOutput(torch.cat(logits) if want_logits else None)

    def decode(
        self, tokens: list[int], positions: list[int], seq_ids: list[list[int]], want_logits: bool
    ) -> torch.Tensor | None:
        """One llama_decode; seq_ids: each token's sequences (a tree node is in every branch below it)."""
        count, batch = len(tokens), self.batch
        batch.n_tokens = count
        np.ctypeslib.as_array(batch.token, shape=(count,))[:] = tokens
        np.ctypeslib.as_array(batch.pos, shape=(count,))[:] = positions
        np.ctypeslib.as_array(batch.n_seq_id, shape=(count,))[:] = [len(ids) for ids in seq_ids]
        np.ctypeslib.as_array(batch.logits, shape=(count,))[:] = 1 if want_logits else 0
        for index, ids in enumerate(seq_ids):
            for slot, seq_id in enumerate(ids):
                batch.seq_id[index][slot] = seq_id
        status = self.lib.llama_decode(self.context, batch)
        if status == 1 and self.lib.llama_memory_seq_pos_max(self.memory, self.parking) >= 0:
            # Freeing the parked cells now would make holes before live cells (not exact).
            raise RuntimeError(
                "the llama.cpp KV pool is full, partly of rejected drafts kept until the batch "
                "ends (for exactness): load with a larger context_size or run fewer rows"
            )
        if status != 0:
            raise RuntimeError(
                f"llama_decode failed (status {status})"
                + ("; the KV pool is full: load with a larger context_size" if status == 1 else "")
            )
        if not want_logits:
            return None
        return torch.from_numpy(
            np.ctypeslib.as_array(self.lib.llama_get_logits(self.context), shape=(count, self.vocab_size)).copy()
        )


def load_gguf(
    path: str | Path,
    context_size: int = 8192,
    max_sequences: int = 64,
    batch_size: int = 512,
    threads: int | None = None,
    flash_attention: bool = True,
) -> LanguageModel:
    """A GGUF file on llama.cpp's kernels. context_size is the KV pool shared by every sequence."""
    lib = import_llama_cpp()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    lib.llama_backend_init()
    lib.llama_log_set(LOG_SILENT, ctypes.c_void_p())
    params = lib.llama_model_default_params()
    # No repacked weights: the repacked kernels accumulate a multi-token block in another order
    # than one token (Q4_K_M Qwen2.5 1.5B: a 5-token verify block off by up to 0.37 in a logit).
    # Plain ggml kernels are exact, at a price on blocks (measured: docs/llama-cpp.md).
    params.use_extra_bufts = False
    model = lib.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise ValueError(f"llama.cpp could not load {path}: not a GGUF model file, or truncated")
    # As many threads as torch uses (its default: the physical cores, llama.cpp's own default too), so
    # torch.set_num_threads / OMP_NUM_THREADS limit both backends alike.
    threads = threads or torch.get_num_threads()
    network = LlamaCppNetwork(lib, model, context_size, max_sequences, batch_size, threads, flash_attention)
    vocab = lib.llama_model_get_vocab(model)
    eos = tuple(token for token in range(network.vocab_size) if lib.llama_vocab_is_eog(vocab, token))
    max_context = min(lib.llama_model_n_ctx_train(model), context_size)
    return LanguageModel(
        network=network,
        tokenizer=LlamaCppTokenizer(lib, vocab),
        name=path.stem,
        vocab_size=network.vocab_size,
        max_context=max_context,
        eos_token_ids=eos,
        backend="llama.cpp",
        dtype=torch.float32,
        path=str(path),
    )


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def LOG_SILENT(level, text, user_data):  # noqa: N802 - llama.cpp's log callback; keeps stderr clean
    pass
