"""Prompt lookup when it finds a match, the draft model otherwise."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..decoding.proposal import Proposal
from ..decoding.sampling import SamplingParams
from .draft_model import DraftModelDrafter
from .ngram import NgramDrafter


class HybridDrafter:
    """Propose the n-gram continuation when the tail matches (free, and long on repeated
    code), else the draft model's proposal. The draft model catches up on the tokens it
    skipped in one pass the next time it proposes. One sequence (slot 0), as the draft
    model's drafter."""

    def __init__(self, ngram: NgramDrafter, model: DraftModelDrafter) -> None:
        self.ngram, self.model = ngram, model
        self.name = f"hybrid({ngram.name}+{model.name})"
        self._last = model

    def verify_width(self, k: int) -> int:
        return max(self.ngram.verify_width(k), self.model.verify_width(k))

    def join(self, slot: int, prompt: torch.Tensor, params: SamplingParams, generator: torch.Generator,
             max_len: int) -> None:
        self.ngram.join(slot, prompt, params, generator, max_len)
        self.model.join(slot, prompt, params, generator, max_len)

    def propose(self, slots: Sequence[int], sequences: Sequence[torch.Tensor], ks: Sequence[int]) -> list[Proposal]:
        proposals = self.ngram.propose(slots, sequences, ks)
        self._last = self.ngram if proposals[0].size else self.model
        return proposals if proposals[0].size else self.model.propose(slots, sequences, ks)

    def verified(self, slot: int, length: int, path: list[int]) -> None:
        self._last.verified(slot, length, path)

    def leave(self, slot: int) -> None:
        self.ngram.leave(slot)
        self.model.leave(slot)
