"""Drafters propose tokens; the engine's one loop verifies them with an acceptance rule."""

from .base import EMPTY, Drafter, NoDrafter, Proposal
from .draft_model import DraftModelDrafter

__all__ = ["EMPTY", "Drafter", "DraftModelDrafter", "NoDrafter", "Proposal"]
