"""The drafter interface: who proposes tokens for the target to verify (the drafters
themselves are in ``quickdraft/drafters``).

One interface serves both loops. A drafter sees sequences by slot: the batched engine
(:class:`~quickdraft.decoding.batch_engine.BatchEngine`) gives each row the slot of its
KV-cache row, and the batch-1 loop (:func:`~quickdraft.decoding.engine.decode`) is a batch
of one in slot 0. A drafter built for one sequence (token trees, multi-draft, a draft
model with a batch-1 cache of its own) serves slot 0 only and refuses any other in
``join`` (:func:`check_single_slot`); a batched drafter serves many slots, and slot 0 of
``decode`` too. The batched engine verifies chains only (token trees stay batch 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from .proposal import EMPTY, Proposal
from .sampling import SamplingParams

__all__ = ["EMPTY", "Drafter", "NoDrafter", "Proposal", "check_single_slot"]


class Drafter(Protocol):
    """Proposes token trees (a chain is a tree) for the sequences in its slots.

    Per sequence the engine calls ``join`` once, then per step ``propose`` (for every
    sequence at once) and ``verified`` (per sequence), and ``leave`` at the end. The
    batch-1 loop calls ``verify_width`` once before ``join``. ``name`` labels the method in
    summaries (e.g. ``tree(2,2,1)``).

    Optionally (the batched engine looks for it) a drafter that runs the target's first
    layers names ``adopts_layer`` and has ``adopt(slot, hidden, target_cache)``: it then
    takes a joining row's prefill from the target's prefill pass.

    Optionally (both loops look for it) a drafter that reads the target (heads: Medusa,
    EAGLE, a prophet transformer) names the hidden states it reads in ``reads_hidden``
    (layer numbers as in ``Transformer.forward``'s ``output_hidden_states``; the target's
    ``n_layers`` is its final state before the norm) and has ``observe(slot, start,
    states)``: after each ``verified`` it gets ``{layer: [m, H]}``, the states of the
    sequence's tokens at positions ``start .. start + m - 1`` that the target has now seen
    and accepted (its prefill first, then each pass's accepted tokens), taken from the
    verify pass itself: no extra target pass. The step's new token, not yet fed to the
    target, comes in the next call. Native runtime only.

    Optionally (the batch-1 loop looks for it, when decoding greedily by its own rule) a
    drafter whose greedy rounds can run several at a time in one C call has
    ``greedy_rounds(target, sequence, length, k, remaining, context, stop_ids, chunk)``:
    it runs them (writing the settled tokens into ``sequence``) and returns their counts
    (``cpu_kernels.SpecRounds``), the same tokens, caches and counts as the loop's rounds
    through ``propose``, ``verified`` and ``observe``; or None where it cannot.
    """

    name: str

    def verify_width(self, k: int) -> int:
        """The most tokens one verify pass feeds the target for proposals of depth <= ``k``:
        the most nodes + 1 (1 for a drafter that never proposes). The engine leaves this
        much room in the KV cache past the sequence."""

    def join(self, slot: int, prompt: torch.Tensor, params: SamplingParams, generator: torch.Generator,
             max_len: int) -> None:
        """A sequence starts in ``slot`` after ``prompt``; ``max_len`` bounds its tokens + one
        proposal. ``params`` and ``generator`` are the sequence's own (the target's): a
        drafter that samples draws from them. A drafter that cannot serve ``slot`` (one
        built for a single sequence, asked for a second) raises ValueError."""

    def propose(self, slots: Sequence[int], sequences: Sequence[torch.Tensor], ks: Sequence[int]) -> list[Proposal]:
        """One proposal per slot: a tree of depth <= ``ks[i]`` after ``sequences[i]`` (the
        prompt + emitted tokens so far of the sequence in ``slots[i]``); ``EMPTY`` for
        nothing (always for ``ks[i] == 0``; that row's step is then a plain step)."""

    def verified(self, slot: int, length: int, path: list[int]) -> None:
        """The first ``length`` tokens of the sequence in ``slot`` were final before its last
        proposal; of that proposal, the nodes ``path`` (root down) were accepted (for a chain,
        ``list(range(accepted))``). Roll own state for the slot back to that."""

    def leave(self, slot: int) -> None:
        """The sequence in ``slot`` is done (finished or cancelled); the slot may be reused."""


def check_single_slot(drafter, slot: int) -> None:
    """For a drafter that serves one sequence at a time (in slot 0, as ``decode`` runs it):
    a one-line ValueError for any other slot."""
    if slot != 0:
        raise ValueError(f"the {drafter.name} drafter drafts for one sequence at a time (slot 0), "
                         f"not slot {slot}; more rows need a batched drafter")


class NoDrafter:
    """Proposes nothing: either loop then is plain (autoregressive) decoding, for any
    number of slots."""

    name = "ar"

    def verify_width(self, k: int) -> int:
        return 1

    def join(self, slot: int, prompt: torch.Tensor, params: SamplingParams, generator: torch.Generator,
             max_len: int) -> None:
        pass

    def propose(self, slots: Sequence[int], sequences: Sequence[torch.Tensor], ks: Sequence[int]) -> list[Proposal]:
        return [EMPTY] * len(slots)

    def verified(self, slot: int, length: int, path: list[int]) -> None:
        pass

    def leave(self, slot: int) -> None:
        pass
