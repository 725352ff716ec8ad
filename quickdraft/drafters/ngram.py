"""Prompt lookup: propose what followed the last earlier occurrence of the sequence's tail
(else, with a datastore, what followed it in text the target wrote before)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..decoding.proposal import EMPTY, Proposal
from ..decoding.sampling import SamplingParams
from .datastore import Datastore

if TYPE_CHECKING:
    from ..models.cpu_kernels import SpecRounds
    from ..models.lm import CausalLM


class NgramDrafter:
    """No model: find the longest tail of ``ngram_max`` down to ``ngram_min`` tokens that
    occurred before in prompt + output and propose the tokens that followed it (the most
    recent occurrence with a full continuation, else the earliest one). Proposals are
    deterministic (one-hot q). When nothing matches it proposes nothing, so the step is a
    plain one and costs what plain decoding costs. It keeps no state, so it serves any
    number of rows (slots) alike.

    With a ``datastore`` (:mod:`.datastore`), a tail that occurs nowhere earlier is looked up
    there, and its continuation proposed when the store is confident of it.
    """

    def __init__(self, ngram_max: int = 3, ngram_min: int = 2, datastore: Datastore | None = None) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"n-gram sizes need 1 <= ngram_min <= ngram_max, got {ngram_min} and {ngram_max}")
        self.ngram_max, self.ngram_min, self.datastore = ngram_max, ngram_min, datastore
        self.name = f"ngram({ngram_max}..{ngram_min})" + (f"+{datastore.name}" if datastore is not None else "")

    def verify_width(self, k: int) -> int:
        return k + 1

    def join(self, slot: int, prompt: torch.Tensor, params: SamplingParams, generator: torch.Generator,
             max_len: int) -> None:
        pass

    def propose(self, slots: Sequence[int], sequences: Sequence[torch.Tensor], ks: Sequence[int]) -> list[Proposal]:
        return [self.lookup(sequence, k) if k > 0 else EMPTY for sequence, k in zip(sequences, ks)]

    def lookup(self, sequence: torch.Tensor, k: int) -> Proposal:
        """The chain of at most ``k`` (>= 1) tokens after ``sequence`` (a host tensor;
        ``EMPTY``: no match)."""
        length = sequence.shape[0]
        # The ids' bytes searched by bytes.find / rfind (C loops): a dozen small tensor ops
        # per tail size took ~0.1 ms a step, 2% of a SmolLM2 round.
        data = sequence.numpy().astype(np.int64, copy=False).tobytes()
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            tail = data[(length - n) * WORD :]
            # the latest earlier occurrence with k tokens after it: inside tokens 0 .. length - k - 1
            start = _search(data, tail, (length - k) * WORD, last=True) if length - k >= n else None
            if start is None:  # else the earliest earlier one: inside tokens 0 .. length - 2
                start = _search(data, tail, (length - 1) * WORD, last=False)
            if start is None:
                continue
            begin = start + n
            return Proposal.chain(sequence[begin : begin + k].clone())
        if self.datastore is not None:
            found = self.datastore.lookup(sequence.numpy(), k)
            if self.datastore.confident(found):
                return Proposal.chain(torch.tensor(found.tokens, dtype=torch.long))
        return EMPTY

    def greedy_rounds(self, target: CausalLM, sequence: torch.Tensor, length: int, k: int, remaining: int,
                      context: int, stop_ids: Sequence[int], chunk: int) -> SpecRounds | None:
        """Greedy rounds of prompt lookup, verified by ``target``, in one C call
        (``NativeLM.spec_rounds``): the tokens and counts the engine's rounds through
        :meth:`propose` give. None with a datastore (searched in Python) or where the
        call does not run."""
        spec_rounds = getattr(target, "spec_rounds", None)
        if spec_rounds is None or self.datastore is not None:
            return None
        return spec_rounds(sequence, length, None, (0, 0, 0), None, k, 0, (self.ngram_max, self.ngram_min), remaining,
                           context, chunk, stop_ids)

    def verified(self, slot: int, length: int, path: list[int]) -> None:
        pass

    def leave(self, slot: int) -> None:
        pass


WORD = 8  # bytes of a token id (int64)


def _search(data: bytes, tail: bytes, end: int, last: bool) -> int | None:
    """The token index of the ``last`` (else the first) occurrence of ``tail`` (whole ids)
    in ``data[:end]``; None if none. A match straddling ids is skipped and the search goes on."""
    lo, hi = 0, end
    while (at := (data.rfind if last else data.find)(tail, lo, hi)) >= 0:
        if at % WORD == 0:
            return at // WORD
        if last:
            hi = at + len(tail) - 1  # occurrences starting before this one
        else:
            lo = at + 1
    return None
