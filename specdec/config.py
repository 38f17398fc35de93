"""One typed, frozen description of what speculates and how: ``SpeculationConfig``.

Every surface builds one and nothing else decides: the command line (``from_args``), the Python
API (``SpeculationConfig(...)``, then ``make_drafter`` / ``engine_options``), the server's flags
(``from_args`` with its ``speculation`` mode) and bench's method names (``from_method``:
"DRAFTER:POLICY@FLAG"). It is validated once, when built: a combination that does not apply is a
ValueError naming the option, never an option accepted and then ignored. The string specs
("suffix-or-head", "A+B", acceptance specs) stay a parse-only surface: they are read here into
fields. This module imports nothing heavy (no torch), so a command line's mistakes answer before
any model loads."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

from specdec.names import (
    AUTO,
    CORPUS_DRAFTERS,
    DRAFTERS,
    HEAD_FLAG,
    NO_DRAFTER,
    NO_INDEX,
    NO_INDEX_FLAG,
    NO_PREDICTION_FLAG,
    POLICIES,
    SPECULATION_MODES,
    TREE_BUDGET,
    TREE_KINDS,
    TREE_POLICIES,
    UNRELATED_PREDICTION_FLAG,
    VOCAB_RULES,
    base_kinds,
    default_gamma,
    drafts_trees,
    uses_corpus,
)

# The closed sets of values, as types (tests/test_assembly.py checks them against specdec.names).
PolicyName = Literal["fixed", "heuristic", "threshold", "cost", "auto", "tree-cost"]
VocabRule = Literal["point-mass", "intersection"]
SpeculationMode = Literal["auto", "on", "off"]
# A drafter object the caller built (SpeculationConfig.of_drafter): made by no name, so no name applies.
GIVEN = "given"
TARGET_ONLY = "target-only"  # bench's method of the target alone (its reference)
BENCH_FLAGS = (NO_INDEX_FLAG, NO_PREDICTION_FLAG, UNRELATED_PREDICTION_FLAG)  # a bench method's flags of its own

# Drafters that read the target's hidden states through a draft head (--draft-head).
HEAD_READERS = ("head", "head-tree")
# Drafters whose drafts are n-gram lookups (--ngram-min/--ngram-max).
NGRAM_USERS = ("ngram", "ngram-tree", "staged", "staged-tree", "ngram-edit", AUTO)


@dataclass(frozen=True)
class SpeculationConfig:
    """What speculates and how.

    ``drafter``: a --drafter spec (a name of specdec.names.DRAFTERS, "A+B", "suffix-or-X") or
    "none" (the target alone); ``tree``: the chain drafter's tree kind (TREE_KINDS);
    ``policy``: how much to draft each step (None: the drafter's own: auto's for auto, tree-cost
    for trees, fixed otherwise); ``gamma``: the draft length (a cap for auto and threshold, a
    start for heuristic and cost; None: the policy's default); ``tree_budget``: a tree's nodes
    per step (None: TREE_BUDGET; under tree-cost, the most it may choose); the n-gram and suffix
    settings; ``vocab_rule``: a draft of another tokenizer's, when sampling; ``draft_head``: a
    head folder (None: the one found for the target); ``index``: datastores (specs of
    --index); ``acceptance``: the acceptance rule for requests that name none (docs/acceptance.md);
    ``draft_forced``: a grammar's forced tokens drafted first (--no-forced-tokens: off);
    ``speculation``: a server's controller mode (serve and bench-serve only; None elsewhere);
    ``predicted``: the requests carry predictions, which the prediction drafter copies (auto's
    candidate, or named). ``drafter`` GIVEN: a drafter object the caller built (of_drafter)."""

    drafter: str = AUTO
    tree: bool = False
    policy: PolicyName | None = None
    gamma: int | None = None
    tree_budget: int | None = None
    ngram_max: int = 4
    ngram_min: int = 1
    suffix_cache_tokens: int = 100_000
    vocab_rule: VocabRule = "point-mass"
    draft_head: str | None = None
    index: tuple[str, ...] = ()
    acceptance: str = "exact"  # an acceptance spec (specdec.core.acceptance), in its canonical spelling
    draft_forced: bool = True
    speculation: SpeculationMode | None = None
    predicted: bool = False  # requests carry a prediction (OpenAI's predicted outputs; generate --prediction)
    # Options the caller set explicitly, checked for whether they apply: from_args, those typed;
    # None (the Python API), those whose values differ from the defaults.
    given: frozenset[str] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.given is None:
            object.__setattr__(self, "given", frozenset(
                name for name in CHECKED_OPTIONS if getattr(self, name) != DEFAULTS[name]))
        check(self)

    @property
    def drafts(self) -> bool:
        return self.drafter != NO_DRAFTER

    @property
    def trees(self) -> bool:
        """Whether it drafts token trees (--tree, a tree kind, or a merge A+B)."""
        return self.drafts and (self.tree or drafts_trees(self.drafter))

    @property
    def chosen_policy(self) -> str:
        """The policy that runs: the one named, else the drafter's own."""
        if self.policy is not None:
            return self.policy
        if self.drafter == AUTO:
            return AUTO
        return "tree-cost" if self.trees else "fixed"

    @property
    def chosen_gamma(self) -> int:
        return default_gamma(self.chosen_policy) if self.gamma is None else self.gamma

    @property
    def nodes(self) -> int:
        """A tree drafter's node budget per step."""
        return self.tree_budget or TREE_BUDGET

    @property
    def reads_head(self) -> bool:
        """Whether a draft head may draft: auto's candidate or a head drafter."""
        return self.drafts and any(kind in (AUTO, *HEAD_READERS) for kind in base_kinds(self.drafter))

    @property
    def uses_corpus(self) -> bool:
        return self.drafts and uses_corpus(self.drafter)

    def with_options(self, **changes: Any) -> SpeculationConfig:
        """A copy with ``changes``, validated again."""
        return replace(self, **changes, given=self.options_given | set(changes))

    @property
    def options_given(self) -> frozenset[str]:
        return self.given or frozenset()

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SpeculationConfig:
        """From a command line's drafting options (add_drafting_options; serve's --speculation,
        bench-serve's first --modes). Options a command does not have keep their defaults; those
        typed (``args.argv``, the command as typed) are checked for whether they apply."""
        typed = {token[2:].partition("=")[0].replace("-", "_") for token in getattr(args, "argv", ())
                 if token.startswith("--")}
        values: dict[str, Any] = {}
        for name in ("gamma", "policy", "tree_budget", "draft_head", "ngram_max", "ngram_min",
                     "suffix_cache_tokens", "vocab_rule", "acceptance", "speculation"):
            value = getattr(args, name, None)
            if value is not None:
                values[name] = value
        if getattr(args, "modes", None):  # bench-serve: servers side by side, one per mode
            values["speculation"] = args.modes[0]
        if getattr(args, "index", None):
            values["index"] = tuple(args.index)
        values["tree"] = bool(getattr(args, "tree", False))
        values["predicted"] = bool(getattr(args, "prediction", None))
        values["draft_forced"] = not getattr(args, "no_forced_tokens", False)
        drafter = getattr(args, "drafter", None)
        if getattr(args, "no_draft", False):
            if drafter not in (None, NO_DRAFTER):
                raise ValueError(f"--no-draft and --drafter {drafter} disagree: --no-draft is --drafter {NO_DRAFTER}")
            drafter = NO_DRAFTER
        if drafter is None:  # unset: with --tree, the draft model's tree, else the n-gram's; else auto
            drafter = ("model" if getattr(args, "draft", None) else "ngram") if values["tree"] else AUTO
        given: set[str] = {name for name in ("gamma", "policy", "tree_budget", "draft_head") if name in values}
        given |= ({"tree"} if values["tree"] else set()) | (typed & {"ngram_max", "ngram_min"})
        return cls(drafter=drafter, **values, given=frozenset(given))

    @classmethod
    def of_drafter(cls, drafter: Any, gamma: int | None = None, policy: str | None = None,
                   draft_forced: bool = True) -> SpeculationConfig:
        """The config of a drafter object the caller built (or of a draft model, drafted as "model"):
        its policy and gamma chosen by the rule of a named drafter's (an auto drafter's own; else
        fixed), its combinations refused alike."""
        from specdec.models.base import LanguageModel

        kind = AUTO if getattr(drafter, "default_policy", None) == AUTO else \
            "model" if isinstance(drafter, LanguageModel) else GIVEN
        return cls(drafter=kind, gamma=gamma, policy=cast(PolicyName | None, policy), draft_forced=draft_forced)

    def make_drafter(self, target: Any, draft: Any = None, head: Any = None, corpus: Sequence[Any] = (),
                     costs: Any = None, **overrides: Any) -> Any:
        """The drafter this config names on loaded models (specdec.drafting.make_drafter; None: the
        target alone). ``head``: a DraftHead or folder (draft_head's, or the one found for the
        target); ``costs``: the engine's cost model (auto decides with it); ``overrides``: keywords
        of make_drafter (``suffix_cache_tokens=0``)."""
        if not self.drafts:
            return None
        if self.drafter == GIVEN:
            raise ValueError("this config describes a drafter object given to build_engine(drafter=...): it names "
                             "none to make")
        from specdec.drafting import make_drafter

        options = dict(max_n=self.ngram_max, min_n=self.ngram_min, tree=self.tree, tree_budget=self.nodes,
                       target=target, vocab_rule=self.vocab_rule, head=head,
                       suffix_cache_tokens=self.suffix_cache_tokens, corpus=corpus, costs=costs)
        return make_drafter(self.drafter, draft, **{**options, **overrides})

    def make_policy(self, costs: Any = None) -> Any:
        """The draft-length policy that runs (specdec.core.policy.make_policy), on the engine's ``costs``."""
        from specdec.core.policy import make_policy

        return make_policy(self.chosen_policy, self.chosen_gamma, self.tree_budget, costs)

    @classmethod
    def from_method(cls, name: str) -> tuple[SpeculationConfig, list[str]]:
        """A bench method "DRAFTER:POLICY@FLAG@..." (e.g. "ngram:cost", "auto", "target-only@unforced"):
        the config, with what its flags say of speculation ("@unforced": a grammar's forced tokens
        not drafted; "@head=DIR": the head in DIR as draft_head, marked given; "@ACCEPTANCE": a
        LOSSY acceptance, marked given), and bench's own flags (BENCH_FLAGS), in order. The one
        parser of method names."""
        from specdec.core.acceptance import canonical_acceptance

        method, *flags = name.split("@")
        drafter, _, policy = method.partition(":")
        bench_flags: list[str] = []
        values: dict[str, Any] = {}
        for flag in flags:
            if flag in BENCH_FLAGS:
                bench_flags.append(flag)
            elif flag == "unforced":
                values["draft_forced"] = False
            elif flag.startswith(HEAD_FLAG):
                values["draft_head"] = flag[len(HEAD_FLAG):]
                if not values["draft_head"]:
                    raise ValueError(f"@{HEAD_FLAG} in {name!r} names no folder: @{HEAD_FLAG}DIR")
            else:
                try:
                    values["acceptance"] = canonical_acceptance(flag)
                except ValueError as error:
                    raise ValueError(f"unknown method flag @{flag} in {name!r}: the flags are @unforced, "
                                     f"@{HEAD_FLAG}DIR, @{', @'.join(BENCH_FLAGS)} and @ACCEPTANCE ({error})") from None
        given = {"policy"} if policy else set()
        config = cls(drafter=NO_DRAFTER if drafter == TARGET_ONLY else drafter,
                     policy=cast(PolicyName | None, policy or None), **values,
                     given=frozenset(given | ({"acceptance", "draft_head"} & set(values))))
        return config, bench_flags


# The options whose applicability check() tests where the caller set them, and their defaults.
CHECKED_OPTIONS = ("policy", "gamma", "tree", "tree_budget", "draft_head", "ngram_max", "ngram_min")
DEFAULTS = {name: SpeculationConfig.__dataclass_fields__[name].default for name in CHECKED_OPTIONS}


def check(config: SpeculationConfig) -> None:
    """Every combination that does not apply, as one ValueError naming the option."""
    kinds = base_kinds(config.drafter)
    if config.drafter not in (NO_DRAFTER, GIVEN):
        unknown = [kind for kind in kinds if kind not in DRAFTERS]
        if unknown or not config.drafter:
            raise ValueError(f"unknown --drafter {(unknown or [config.drafter])[0]!r}; choose one of "
                             f"{', '.join(DRAFTERS)} or {NO_DRAFTER} (or join drafters with +)")
    for name, least in (("gamma", 0), ("tree_budget", 1), ("suffix_cache_tokens", 0)):
        value = getattr(config, name)
        if value is not None and value < least:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {least}, got {value}")
    if not 1 <= config.ngram_min <= config.ngram_max:
        raise ValueError(f"--ngram-min and --ngram-max need 1 <= min <= max, got {config.ngram_min} and "
                         f"{config.ngram_max}")
    if config.policy is not None and config.policy not in POLICIES + TREE_POLICIES:
        raise ValueError(f"unknown --policy {config.policy!r}; choose one of {', '.join(POLICIES + TREE_POLICIES)}")
    if config.vocab_rule not in VOCAB_RULES:
        raise ValueError(f"unknown --vocab-rule {config.vocab_rule!r}; choose one of {', '.join(VOCAB_RULES)}")
    if config.speculation is not None:
        if config.speculation not in SPECULATION_MODES:
            raise ValueError(f"unknown --speculation {config.speculation!r}; choose one of "
                             f"{', '.join(SPECULATION_MODES)}")
        if config.policy is not None:
            raise ValueError("--policy does not apply to a server: its speculation controller chooses every step's "
                             "draft lengths from measured costs (--speculation auto; on: always --gamma; off: none)")
    if not config.drafts:
        applied = sorted(name for name in config.options_given if name in ("policy", "gamma", "tree", "tree_budget",
                                                                   "draft_head"))
        applied += ["prediction"] if config.predicted else []
        if applied:
            raise ValueError(f"--{applied[0].replace('_', '-')} does not apply without a drafter "
                             f"(--drafter {NO_DRAFTER} / --no-draft)")
        return
    kind = config.drafter
    if config.tree and not any(part in TREE_KINDS for part in base_kinds(kind)):
        raise ValueError(f"--tree does not apply to --drafter {kind}: it turns one of {', '.join(TREE_KINDS)} "
                         "into its tree (auto drafts chains)")
    if config.policy == AUTO and kind not in (AUTO, GIVEN):  # (a drafter object may choose its own lengths)
        raise ValueError(f"--policy {AUTO} is the auto drafter's own (it chooses each step's draft and length); "
                         f"give --drafter {AUTO}, or another --policy for --drafter {kind}")
    if kind == AUTO and config.policy not in (None, AUTO):
        raise ValueError(f"--policy {config.policy} does not apply to --drafter {AUTO}: it chooses each step's "
                         "draft and its length itself, up to --gamma, with the engine's one cost model")
    if config.tree_budget is not None and not config.trees:
        raise ValueError(f"--tree-budget does not apply to --drafter {kind}: it drafts chains (a tree drafter, "
                         "--tree or A+B drafts trees)")
    if config.draft_head is not None and not config.reads_head:
        raise ValueError(f"--draft-head does not apply to --drafter {kind}: only auto, head and head-tree draft "
                         "with a head")
    if config.index and config.index != (NO_INDEX,) and not config.uses_corpus:  # ("none" asks for nothing)
        raise ValueError(f"--index does not apply to --drafter {kind}: only auto and "
                         f"{', '.join(CORPUS_DRAFTERS)} draft from datastores")
    if config.predicted and not any(part in (AUTO, "prediction") for part in base_kinds(kind)):
        raise ValueError(f"--prediction does not apply to --drafter {kind}: auto (the default) or a drafter spec "
                         "holding prediction drafts from it")
    ngram = {"ngram_max", "ngram_min"} & config.options_given
    if ngram and not any(kind in NGRAM_USERS or kind.startswith("suffix-or-ngram") for kind in base_kinds(kind)):
        raise ValueError(f"--{sorted(ngram)[0].replace('_', '-')} does not apply to --drafter {kind}: no n-gram "
                         "lookup drafts there")
