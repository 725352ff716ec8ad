"""Prompt lookup when it finds a match, a model's drafter otherwise (``hybrid``: a draft
model; ``hybrid-eagle``: an EAGLE drafter)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..decoding.drafter import Drafter
from ..decoding.proposal import Proposal
from ..decoding.sampling import SamplingParams
from .ngram import NgramDrafter

if TYPE_CHECKING:
    from ..models.cpu_kernels import SpecRounds
    from ..models.lm import CausalLM


class HybridDrafter:
    """Propose the n-gram continuation when a row's tail matches (free, and long on
    repeated code), else the draft model's proposal. The draft model catches up on the
    tokens it skipped in one pass the next time it proposes for the row.

    ``model`` is the draft model's drafter: ``DraftModelDrafter`` (one sequence) or
    ``BatchedDraftModel`` (many rows); the hybrid serves the slots it serves. Or an
    ``EagleDrafter``, which reads the target's states: the hybrid asks for them
    (``reads_hidden``) and hands every pass's on (``observe``), n-gram rounds' too, so the
    drafter can feed the tokens it skipped, each with its own feature, when it next drafts.
    """

    def __init__(self, ngram: NgramDrafter, model: Drafter, own_k: tuple[int, str] | None = None,
                 fixed_k: int | None = None) -> None:
        """``own_k``: the k (and its source) the generator settles on when none is given;
        ``fixed_k``: the k batched rows draft when none is given (None: the batch policy's)."""
        self.ngram, self.model, self.own_k, self.fixed_k = ngram, model, own_k, fixed_k
        self.name = f"hybrid({ngram.name}+{model.name})"
        self._by_ngram: set[int] = set()  # slots whose last proposal was the n-gram's
        self.reads_hidden = tuple(getattr(model, "reads_hidden", ()))  # the engine asks for these states

    def verify_width(self, k: int) -> int:
        return max(self.ngram.verify_width(k), self.model.verify_width(k))

    def join(self, slot: int, prompt: torch.Tensor, params: SamplingParams, generator: torch.Generator,
             max_len: int) -> None:
        self.ngram.join(slot, prompt, params, generator, max_len)
        self.model.join(slot, prompt, params, generator, max_len)
        self._by_ngram.discard(slot)

    def propose(self, slots: Sequence[int], sequences: Sequence[torch.Tensor], ks: Sequence[int]) -> list[Proposal]:
        found = self.ngram.propose(slots, sequences, ks)
        rest = [0 if p.size else k for p, k in zip(found, ks)]
        for slot, p in zip(slots, found):
            if p.size:
                self._by_ngram.add(slot)
            else:
                self._by_ngram.discard(slot)
        if not any(rest):
            return found
        drafted = self.model.propose(slots, sequences, rest)
        return [p if p.size else d for p, d in zip(found, drafted)]

    def greedy_rounds(self, target: CausalLM, sequence: torch.Tensor, length: int, k: int, remaining: int,
                      context: int, stop_ids: Sequence[int], chunk: int) -> SpecRounds | None:
        """The model drafter's greedy rounds in one C call with prompt lookup first
        (``EagleDrafter.greedy_rounds``, ``DraftModelDrafter.greedy_rounds``), where it has
        them and the lookup has no datastore; else None."""
        rounds = getattr(self.model, "greedy_rounds", None)
        if rounds is None or self.ngram.datastore is not None:
            return None
        return rounds(target, sequence, length, k, remaining, context, stop_ids, chunk,
                      ngram=(self.ngram.ngram_max, self.ngram.ngram_min))

    def verified(self, slot: int, length: int, path: list[int]) -> None:
        # The draft model hears only of its own proposals: after an n-gram chain its state
        # is a prefix of the sequence still, and it catches up when it next proposes.
        if slot not in self._by_ngram:
            self.model.verified(slot, length, path)

    def observe(self, slot: int, start: int, states: dict[int, torch.Tensor]) -> None:
        self.model.observe(slot, start, states)  # only called when reads_hidden names states

    def leave(self, slot: int) -> None:
        self._by_ngram.discard(slot)
        self.ngram.leave(slot)
        self.model.leave(slot)
