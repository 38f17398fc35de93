from specdec.drafting.base import Draft, Drafter, DraftRequest, StepOutcome
from specdec.drafting.model import ModelDrafter
from specdec.drafting.ngram import NGramDrafter, NGramIndex
from specdec.drafting.staged import StagedDrafter

DRAFTERS = ("model", "ngram", "staged")


def make_drafter(kind: str, draft_model=None, max_n: int = 4, min_n: int = 1) -> Drafter:
    """A drafter by name: "model" and "staged" need the draft model, "ngram" needs none."""
    if kind not in DRAFTERS:
        raise ValueError(f"unknown drafter {kind!r}; choose one of {', '.join(DRAFTERS)}")
    if kind == "ngram":
        return NGramDrafter(max_n, min_n)
    if draft_model is None:
        raise ValueError(f"the {kind!r} drafter needs a draft model (--draft)")
    return ModelDrafter(draft_model) if kind == "model" else StagedDrafter(draft_model, max_n, min_n)


__all__ = ["DRAFTERS", "Draft", "Drafter", "DraftRequest", "StepOutcome", "ModelDrafter", "NGramDrafter", "NGramIndex", "StagedDrafter",
           "make_drafter"]
