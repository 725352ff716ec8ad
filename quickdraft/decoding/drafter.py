"""The drafter interfaces: who proposes tokens for the target to verify, for one sequence
(:class:`Drafter`, token trees) and for the rows of a batch (:class:`BatchDrafter`, chains;
the drafters themselves are in ``quickdraft/drafters``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from .proposal import EMPTY, Proposal
from .sampling import SamplingParams

__all__ = ["EMPTY", "BatchDrafter", "BatchedNoDrafter", "Drafter", "NoDrafter", "Proposal"]


class Drafter(Protocol):
    """Proposes continuations as token trees (a chain is a tree). The engine calls, per
    generation, ``verify_width`` and ``start`` once, then per step ``propose`` and
    ``verified``. ``name`` labels the method in summaries (e.g. ``tree(2,2,1)``)."""

    name: str

    def verify_width(self, k: int) -> int:
        """The most tokens one verify pass feeds the target for proposals of depth <= ``k``:
        the most nodes + 1 (1 for a drafter that never proposes). The engine leaves this
        much room in the KV cache past the sequence."""

    def start(self, prompt: torch.Tensor, params: SamplingParams, generator: torch.Generator, max_len: int) -> None:
        """A new generation after ``prompt``; ``max_len`` bounds the sequence + one proposal.
        ``params`` and ``generator`` are the target's: a drafter that samples uses them."""

    def propose(self, sequence: torch.Tensor, k: int) -> Proposal:
        """A tree of depth <= ``k`` after ``sequence`` (prompt + emitted tokens so far);
        ``EMPTY`` for nothing (the step is then a plain step)."""

    def verified(self, length: int, path: list[int]) -> None:
        """The first ``length`` tokens of the sequence were final before the last proposal;
        of it, the nodes ``path`` (root down) were accepted. Roll own state back to that."""


class NoDrafter:
    """Proposes nothing: the one decode loop then is plain autoregressive decoding."""

    name = "ar"

    def verify_width(self, k: int) -> int:
        return 1

    def start(self, prompt: torch.Tensor, params: SamplingParams, generator: torch.Generator, max_len: int) -> None:
        pass

    def propose(self, sequence: torch.Tensor, k: int) -> Proposal:
        return EMPTY

    def verified(self, length: int, path: list[int]) -> None:
        pass


class BatchDrafter(Protocol):
    """Proposes a chain per row of a batch (see the module docstring)."""

    name: str

    def join(self, slot: int, prompt: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> None:
        """A row starts in ``slot`` after ``prompt``, sampling with its own ``params`` and
        ``generator`` (the target's: a drafter that samples draws from it)."""

    def propose(self, slots: Sequence[int], sequences: Sequence[torch.Tensor], ks: Sequence[int]) -> list[Proposal]:
        """A chain of at most ``ks[i]`` tokens after ``sequences[i]`` for the row in ``slots[i]``."""

    def verified(self, slot: int, length: int, accepted: int) -> None:
        """Of the row's last chain (proposed after ``length`` tokens) ``accepted`` tokens were kept."""

    def leave(self, slot: int) -> None:
        """The row in ``slot`` is gone; the slot may be reused."""


class BatchedNoDrafter:
    """Proposes nothing: the batched engine then is batched plain decoding."""

    name = "ar"

    def join(self, slot, prompt, params, generator) -> None:
        pass

    def propose(self, slots, sequences, ks) -> list[Proposal]:
        return [EMPTY] * len(slots)

    def verified(self, slot, length, accepted) -> None:
        pass

    def leave(self, slot) -> None:
        pass
