"""Drafters propose token trees; the engine's one loop verifies them with an acceptance rule."""

from ..decoding.drafter import EMPTY, Drafter, NoDrafter, Proposal
from .draft_model import DraftModelDrafter
from .factory import METHODS, NEEDS_DRAFT, DraftOptions, make_drafter
from .ngram import NgramDrafter

__all__ = [
    "EMPTY", "METHODS", "NEEDS_DRAFT", "DraftModelDrafter", "DraftOptions", "Drafter", "NgramDrafter",
    "NoDrafter", "Proposal", "make_drafter",
]
