"""Prompt lookup: propose what followed the last earlier occurrence of the sequence's tail."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..decoding.proposal import EMPTY, Proposal
from ..decoding.sampling import SamplingParams


class NgramDrafter:
    """No model: find the longest tail of ``ngram_max`` down to ``ngram_min`` tokens that
    occurred before in prompt + output and propose the tokens that followed it (the most
    recent occurrence with a full continuation, else the earliest one). Proposals are
    deterministic (one-hot q). When nothing matches it proposes nothing, so the step is a
    plain one and costs what plain decoding costs. It keeps no state, so it serves any
    number of rows (slots) alike.
    """

    def __init__(self, ngram_max: int = 3, ngram_min: int = 2) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"n-gram sizes need 1 <= ngram_min <= ngram_max, got {ngram_min} and {ngram_max}")
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.name = f"ngram({ngram_max}..{ngram_min})"

    def verify_width(self, k: int) -> int:
        return k + 1

    def join(self, slot: int, prompt: torch.Tensor, params: SamplingParams, generator: torch.Generator,
             max_len: int) -> None:
        pass

    def propose(self, slots: Sequence[int], sequences: Sequence[torch.Tensor], ks: Sequence[int]) -> list[Proposal]:
        return [self.lookup(sequence, k) if k > 0 else EMPTY for sequence, k in zip(sequences, ks)]

    def lookup(self, sequence: torch.Tensor, k: int) -> Proposal:
        """The chain of at most ``k`` tokens after ``sequence`` (``EMPTY``: no match)."""
        length = sequence.shape[0]
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            # Windows starting at 0 .. length - n - 1: every earlier occurrence, not the tail itself.
            windows = sequence[: length - 1].unfold(0, n, 1)
            starts = (windows == sequence[length - n :]).all(dim=1).nonzero().view(-1)
            if starts.numel() == 0:
                continue
            full = starts[starts + n + k <= length]
            begin = int(full[-1] if full.numel() else starts[0]) + n
            return Proposal.chain(sequence[begin : begin + k].clone())
        return EMPTY

    def verified(self, slot: int, length: int, path: list[int]) -> None:
        pass

    def leave(self, slot: int) -> None:
        pass
