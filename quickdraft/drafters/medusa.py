"""``--method medusa``: K Medusa heads read the target's final hidden state of the last
token it accepted and propose a token tree; the engine verifies it in one pass.

The heads do not condition on one another, so the tree is SpecInfer's bounded expansion
(``--tree w1,w2,...``, one level per head): every node at depth ``d`` gets the top-``w_{d+1}``
tokens of head ``d + 1``. Children are deterministic (one-hot q), so the engine's exact
tree rule keeps sampled output distributed as the target's: lossless. (Medusa's "typical
acceptance" is not offered: it changes the output distribution.)

The state comes from the contract of drafters that read the target
(:mod:`quickdraft.decoding.drafter`): after each verify pass the engine hands the states of
the tokens just accepted; the last one is of the token before the step's new token, so
the LM head's prediction from it is that new token and head ``i`` (0-based) predicts the
``i + 1``-th token after it, the ``i``-th draft level.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch

from ..decoding.drafter import EMPTY, Proposal, check_single_slot
from ..decoding.sampling import SamplingParams
from ..models.lm import HIDDEN_STATES_NEED_NATIVE, CausalLM, NativeLM
from ..models.medusa import FILES as MEDUSA_FILES
from ..models.medusa import MedusaConfig, MedusaHeads, load_medusa
from .shipped import shipped_for


class MedusaDrafter:
    """Proposes a static token tree from Medusa heads (batch 1, slot 0)."""

    def __init__(self, target: NativeLM, heads: MedusaHeads, widths: Sequence[int]) -> None:
        if not isinstance(target, NativeLM):
            raise ValueError(HIDDEN_STATES_NEED_NATIVE)
        self.target, self.heads = target.model, heads
        self.widths = tuple(widths)[: heads.num_heads]
        self.reads_hidden = (target.config.n_layers,)
        self.name = f"medusa({','.join(map(str, self.widths))})"
        self._state: torch.Tensor | None = None

    def depth(self, k: int) -> int:
        return min(k, len(self.widths))

    def verify_width(self, k: int) -> int:
        return 1 + sum(math.prod(self.widths[: d + 1]) for d in range(self.depth(k)))

    def join(self, slot: int, prompt: torch.Tensor, params: SamplingParams, generator: torch.Generator,
             max_len: int) -> None:
        check_single_slot(self, slot)
        self._state = None

    @torch.inference_mode()
    def propose(self, slots: Sequence[int], sequences: Sequence[torch.Tensor], ks: Sequence[int]) -> list[Proposal]:
        depth = self.depth(ks[0])
        if depth == 0 or self._state is None:  # nothing read yet: the prefill is a plain step
            return [EMPTY]
        tops = [torch.topk(self.heads.head_logits(i, self._state, self.target), self.widths[i]).indices.tolist()
                for i in range(depth)]
        tokens: list[int] = []
        parents: list[int] = []
        level = [-1]  # the nodes whose children come next (-1: the root)
        for candidates in tops:
            next_level = []
            for parent in level:
                for token in candidates:
                    next_level.append(len(tokens))
                    tokens.append(token)
                    parents.append(parent)
            level = next_level
        return [Proposal(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))]

    def verified(self, slot: int, length: int, path: list[int]) -> None:
        pass  # no state of its own to roll back: the next state comes with observe

    def observe(self, slot: int, start: int, states: dict[int, torch.Tensor]) -> None:
        final = states[self.reads_hidden[0]]
        if final.shape[0]:
            self._state = final[-1]

    def leave(self, slot: int) -> None:
        self._state = None


def shipped_medusa(target: CausalLM) -> Path | None:
    """The Medusa heads packaged for this target, if any."""
    return next(iter(shipped_for(target, MEDUSA_FILES, MedusaConfig)), None)


def medusa_drafter(target: CausalLM | None, heads: str | MedusaHeads | None, widths: Sequence[int]) -> MedusaDrafter:
    """The drafter of ``--method medusa``: ``heads`` loaded already, from a directory, or
    (None) the heads shipped for the target; a one-line error when there are none."""
    return MedusaDrafter(target, load_heads(target, heads), widths)


def load_heads(target: CausalLM | None, heads: str | MedusaHeads | None) -> MedusaHeads:
    """``heads`` as loaded heads for ``target`` (see :func:`medusa_drafter`)."""
    if not isinstance(target, NativeLM):
        raise ValueError(HIDDEN_STATES_NEED_NATIVE)
    if isinstance(heads, MedusaHeads):
        return heads
    path = heads or shipped_medusa(target)
    if path is None:
        raise ValueError("--method medusa needs Medusa heads for this target: pass --heads DIR (train them with "
                         "`quickdraft train heads --kind medusa --target ...`)")
    return load_medusa(path, target.model)
