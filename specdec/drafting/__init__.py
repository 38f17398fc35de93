from collections.abc import Sequence
from pathlib import Path
from typing import cast

from specdec.core.drafts import Draft, Drafter, DraftRequest, StepOutcome
from specdec.core.estimates import CostModel
from specdec.drafting.auto import AutoDrafter
from specdec.drafting.corpus import CorpusDrafter
from specdec.drafting.datastore import Datastore
from specdec.drafting.edits import EditingNGramDrafter
from specdec.drafting.head import DraftHead
from specdec.drafting.head_drafter import HeadDrafter, HeadTreeDrafter
from specdec.drafting.head_format import head_quantization, load_head
from specdec.drafting.merge import MergedDrafter
from specdec.drafting.model import ModelDrafter
from specdec.drafting.ngram import NGramDrafter, NGramIndex
from specdec.drafting.prediction import PredictionDrafter
from specdec.drafting.staged import StagedDrafter, StagedTreeDrafter
from specdec.drafting.suffix import SuffixCache, SuffixDrafter, SuffixFirstDrafter
from specdec.drafting.translate import TranslatingDrafter
from specdec.drafting.tree import ModelTreeDrafter
from specdec.drafting.vocab import fit_to_target, vocabulary_mismatch
from specdec.models.base import LanguageModel
from specdec.names import AUTO, DRAFTERS, SUFFIX_FIRST, TEXT_DRAFTERS, TREE_KINDS, base_kinds

# auto's candidates that need nothing but the text; a head and a draft model join when given
# (prediction drafts only for a request that carries one: OpenAI's predicted outputs)
AUTO_TEXT_CANDIDATES = ("suffix", "ngram", "ngram-edit", "prediction")


def reads_target(drafter: str) -> bool:
    """Whether a drafter spec ("head", "tree+head-tree", ...) reads the target's hidden states."""
    return any(kind in ("head", "head-tree") for kind in base_kinds(drafter))


def make_drafter(
    kind: str,
    draft_model: LanguageModel | None = None,
    max_n: int = 4,
    min_n: int = 1,
    tree: bool = False,
    tree_budget: int = 16,
    target: LanguageModel | None = None,
    vocab_rule: str = "point-mass",
    head: DraftHead | str | Path | None = None,
    suffix_cache_tokens: int = 100_000,
    corpus: Sequence[Datastore] = (),
    costs: CostModel | None = None,
) -> Drafter:
    """A drafter by name: "model", "staged", "tree" and "staged-tree" (the staged chain with the
    draft's next-best tokens as side leaves) need the draft model; "ngram" and "ngram-tree" (the
    continuations of several earlier occurrences as branches) need none; "A+B" merges the
    proposals of A and B into one tree. tree=True turns "model" into "tree", "ngram" into
    "ngram-tree" and "staged" into "staged-tree". With the target given, the draft is paired with
    it by tokenizer: the same tokenizer under another embedding size works as is (logits fitted to
    the target's rows); another tokenizer is translated (TranslatingDrafter, "model" only), its sampled drafts verified
    by vocab_rule ("point-mass" or "intersection", docs/tokenizers.md). "head" and "head-tree" draft
    with a draft head that reads the target's hidden states (``head``: a DraftHead or an EAGLE-3
    folder, loaded for ``target``). "suffix" and "suffix-tree" copy from this request's text and from
    a cache of earlier outputs of at most ``suffix_cache_tokens`` tokens (0: no cache). "ngram-edit"
    is n-gram lookup that learns the edits the output makes to the text it copies (a renamed
    identifier) and makes them in later copies. "corpus" and "corpus-tree" retrieve continuations
    from the datastores in ``corpus`` (specdec.drafting.corpus). "auto" holds the text drafters
    (the corpus drafter where datastores are given), the head (when given) and the draft model
    (when given) as candidates and picks each step's draft by measured cost (specdec.drafting.auto),
    deciding with ``costs``, the cost model of the engine it will serve (None: its own, which an
    engine built with it then takes)."""
    if kind == AUTO:
        names = [*AUTO_TEXT_CANDIDATES, *(["corpus"] if corpus else []),
                 *(["head"] if head is not None and target is not None else []),
                 *(["model"] if draft_model is not None else [])]
        return AutoDrafter({name: make_drafter(name, draft_model, max_n, min_n, False, tree_budget, target, vocab_rule,
                                               head, suffix_cache_tokens, corpus) for name in names}, TEXT_DRAFTERS,
                           costs=costs)
    kinds = kind.split("+")
    if len(kinds) > 1:
        return MergedDrafter(
            [make_drafter(k, draft_model, max_n, min_n, tree, tree_budget, target, vocab_rule, head,
                          suffix_cache_tokens, corpus) for k in kinds],
            budget=tree_budget,
        )
    kind = TREE_KINDS.get(kind, kind) if tree else kind
    if kind.startswith(SUFFIX_FIRST):
        fallback = make_drafter(kind[len(SUFFIX_FIRST):], draft_model, max_n, min_n, tree, tree_budget, target,
                                vocab_rule, head, suffix_cache_tokens, corpus)
        suffix_kind = "suffix-tree" if kind.endswith("tree") else "suffix"
        suffix = make_drafter(suffix_kind, tree_budget=tree_budget, suffix_cache_tokens=suffix_cache_tokens)
        return SuffixFirstDrafter(cast(SuffixDrafter, suffix), fallback)
    if kind not in DRAFTERS:
        raise ValueError(f"unknown drafter {kind!r}; choose one of {', '.join(DRAFTERS)} (or join them with +)")
    if kind == "prediction":
        return PredictionDrafter(tokenizer=None if target is None else target.tokenizer)
    if kind == "ngram-edit":
        return EditingNGramDrafter(max_n, min_n, tokenizer=None if target is None else target.tokenizer)
    if kind in ("ngram", "ngram-tree"):
        return NGramDrafter(max_n, min_n, branches=4 if kind == "ngram-tree" else 1, budget=tree_budget)
    if kind in ("suffix", "suffix-tree"):  # each such drafter keeps its own cache of earlier outputs
        cache = SuffixCache(max_tokens=suffix_cache_tokens)
        return SuffixDrafter(cache, tree=kind == "suffix-tree", budget=tree_budget)
    if kind in ("corpus", "corpus-tree"):  # the datastores are read-only: drafters may share them
        return CorpusDrafter(corpus, tree=kind == "corpus-tree", budget=tree_budget)
    if kind in ("head", "head-tree"):
        if target is None or head is None:
            raise ValueError(f"the {kind!r} drafter needs a draft head (--draft-head DIR) and the target it reads")
        if not isinstance(head, DraftHead):
            head = load_head(head, target, quantize=head_quantization(target))
        if kind == "head":
            return HeadDrafter(head, target.max_context)
        return HeadTreeDrafter(head, target.max_context, budget=tree_budget)
    if draft_model is None:
        raise ValueError(f"the {kind!r} drafter needs a draft model (--draft)")
    mismatch = None if target is None else vocabulary_mismatch(draft_model, target)
    if target is not None and mismatch is not None:
        if draft_model.tokenizer is None or target.tokenizer is None:
            raise ValueError(mismatch)
        if kind != "model":
            raise ValueError(
                f"{mismatch}: only the 'model' drafter translates between tokenizers (the {kind!r} "
                "drafter works in the target's tokens); use --drafter model, or ngram (no draft model)"
            )
        return TranslatingDrafter(draft_model, target, vocab_rule=vocab_rule)
    if target is not None:
        draft_model = fit_to_target(draft_model, target)
    if kind == "tree":
        return ModelTreeDrafter(draft_model, budget=tree_budget)
    if kind == "staged-tree":
        return StagedTreeDrafter(draft_model, max_n, min_n, budget=tree_budget)
    return ModelDrafter(draft_model) if kind == "model" else StagedDrafter(draft_model, max_n, min_n)


__all__ = [
    "AutoDrafter",
    "CorpusDrafter",
    "Datastore",
    "DRAFTERS",
    "Draft",
    "DraftHead",
    "Drafter",
    "DraftRequest",
    "HeadDrafter",
    "HeadTreeDrafter",
    "load_head",
    "StepOutcome",
    "MergedDrafter",
    "ModelDrafter",
    "ModelTreeDrafter",
    "NGramDrafter",
    "NGramIndex",
    "StagedDrafter",
    "StagedTreeDrafter",
    "TranslatingDrafter",
    "make_drafter",
    "reads_target",
    "SuffixCache",
    "SuffixDrafter",
]


def as_drafter(drafter: Drafter | LanguageModel | None, target: LanguageModel) -> Drafter | None:
    """What an engine drafts with, from a drafter object a caller hands over: a loaded draft model
    becomes a "model" drafter paired with the target by tokenizer; drafters and None pass through.
    (A drafter by name is made from a SpeculationConfig: specdec.assembly.build_engine.)"""
    return make_drafter("model", drafter, target=target) if isinstance(drafter, LanguageModel) else drafter
