from specdec.drafting.base import Draft, Drafter
from specdec.drafting.model import ModelDrafter

__all__ = ["Draft", "Drafter", "ModelDrafter"]
