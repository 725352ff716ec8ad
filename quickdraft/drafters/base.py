"""The drafter interface: who proposes tokens for the target to verify."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..sampling import SamplingParams


@dataclass
class Proposal:
    """``tokens`` ``[k]`` proposed after the sequence; ``probs`` ``[k, V]`` the distribution
    each was drawn from, or None for a deterministic drafter (q is then one-hot)."""

    tokens: torch.Tensor
    probs: torch.Tensor | None = None


EMPTY = Proposal(torch.empty(0, dtype=torch.long))


class Drafter(Protocol):
    """Proposes continuations. The engine calls, per generation:

    ``start`` once with the prompt; then per step ``propose`` with the whole sequence so far
    (prompt + emitted tokens) and ``verified`` with how many leading tokens of that sequence
    plus the proposal are now final, so the drafter can roll its own state back.
    """

    name: str

    def start(self, prompt: torch.Tensor, params: SamplingParams, generator: torch.Generator, max_len: int) -> None: ...

    def propose(self, sequence: torch.Tensor, k: int) -> Proposal: ...

    def verified(self, n_valid: int) -> None: ...


class NoDrafter:
    """Proposes nothing: the one decode loop then is plain autoregressive decoding."""

    name = "ar"

    def start(self, prompt: torch.Tensor, params: SamplingParams, generator: torch.Generator, max_len: int) -> None:
        pass

    def propose(self, sequence: torch.Tensor, k: int) -> Proposal:
        return EMPTY

    def verified(self, n_valid: int) -> None:
        pass
