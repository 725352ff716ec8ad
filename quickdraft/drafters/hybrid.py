"""Prompt lookup when it finds a match, the draft model otherwise."""

from __future__ import annotations

import torch

from ..decoding.proposal import Proposal
from ..decoding.sampling import SamplingParams
from .draft_model import DraftModelDrafter
from .ngram import NgramDrafter


class HybridDrafter:
    """Propose the n-gram continuation when the tail matches (free, and long on repeated
    code), else the draft model's proposal. The draft model catches up on the tokens it
    skipped in one pass the next time it proposes."""

    def __init__(self, ngram: NgramDrafter, model: DraftModelDrafter) -> None:
        self.ngram, self.model = ngram, model
        self.name = f"hybrid({ngram.name}+{model.name})"
        self._last = model

    def verify_width(self, k: int) -> int:
        return max(self.ngram.verify_width(k), self.model.verify_width(k))

    def start(self, prompt: torch.Tensor, params: SamplingParams, generator: torch.Generator, max_len: int) -> None:
        self.ngram.start(prompt, params, generator, max_len)
        self.model.start(prompt, params, generator, max_len)

    def propose(self, sequence: torch.Tensor, k: int) -> Proposal:
        proposal = self.ngram.propose(sequence, k)
        self._last = self.ngram if proposal.size else self.model
        return proposal if proposal.size else self.model.propose(sequence, k)

    def verified(self, length: int, path: list[int]) -> None:
        self._last.verified(length, path)
