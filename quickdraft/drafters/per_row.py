"""Batched rows for the head methods (Medusa, prophet, EAGLE): one single-sequence
drafter per row, each drafting a chain.

A head reads the target's hidden states, which the batched engine already hands each row
after its verify pass (``observe``, the same contract as at batch 1), and the heads
themselves are loaded once and shared by every row. What is per row is the drafter's own
state: the last states it read, its cache (EAGLE), its sampling generator. The rows'
draft passes run one after the other, not as one batched pass; the target's verify pass,
the expensive part, is batched as for every other method.

The batched engine verifies chains, so each row drafts one: Medusa with one candidate per
head, EAGLE a chain of its argmax (or, sampling, of draws from it), the prophet as it
always does. A chain is verified by the same exact rule as at batch 1: lossless.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch

from ..decoding.batch_engine import MAX_BATCH_K
from ..decoding.drafter import Drafter
from ..decoding.proposal import Proposal
from ..decoding.sampling import SamplingParams
from ..models.lm import NativeLM
from .factory import HYBRID_EAGLE_K, DraftOptions

#: The head methods and the k they draft with when none is given: a batched row's k (the
#: batch policy measures draft models' steps, not heads', so it does not choose it yet) and
#: the k ``--method auto`` measures them at (medusa's default 2,2,1 tree stops at depth 3;
#: hybrid-eagle's k is its prompt lookup's most, its EAGLE chain shorter).
HEAD_BATCH_K = {"medusa": 4, "prophet": 4, "eagle": 6, "hybrid-eagle": HYBRID_EAGLE_K}


class PerRowDrafter:
    """One batch-1 drafter per slot of the batch, each told about its own row only."""

    def __init__(self, make: Callable[[], Drafter], max_batch_size: int, fixed_k: int) -> None:
        self.rows = [make() for _ in range(max_batch_size)]
        first = self.rows[0]
        self.name = f"{first.name}, per row"
        self.reads_hidden = tuple(getattr(first, "reads_hidden", ()))
        self.fixed_k = fixed_k

    def verify_width(self, k: int) -> int:
        return self.rows[0].verify_width(k)

    def join(self, slot: int, prompt: torch.Tensor, params: SamplingParams, generator: torch.Generator,
             max_len: int) -> None:
        if not 0 <= slot < len(self.rows):
            raise ValueError(f"the {self.name} drafter has {len(self.rows)} slots, not slot {slot}")
        self.rows[slot].join(0, prompt, params, generator, max_len)

    def propose(self, slots: Sequence[int], sequences: Sequence[torch.Tensor], ks: Sequence[int]) -> list[Proposal]:
        return [self.rows[slot].propose([0], [sequence], [k])[0] for slot, sequence, k in zip(slots, sequences, ks)]

    def verified(self, slot: int, length: int, path: list[int]) -> None:
        self.rows[slot].verified(0, length, path)

    def observe(self, slot: int, start: int, states: dict[int, torch.Tensor]) -> None:
        self.rows[slot].observe(0, start, states)

    def leave(self, slot: int) -> None:
        self.rows[slot].leave(0)


def per_row_head_drafter(method: str, target: NativeLM, max_batch_size: int, options: DraftOptions,
                         depth: int = MAX_BATCH_K) -> PerRowDrafter:
    """The batched drafter of a head method: its heads loaded once (``options.heads``: loaded
    heads, a directory, or None for the ones shipped for ``target``), a chain drafter per row
    (EAGLE's at most ``depth`` long, whatever a row's k: hybrid-eagle's chain)."""
    if method == "medusa":
        from .medusa import MedusaDrafter, load_heads

        heads = load_heads(target, options.heads)
        make = partial(MedusaDrafter, target, heads, (1,) * heads.num_heads)
    elif method == "prophet":
        from .prophet import ProphetDrafter, load_prophet_for

        prophet = load_prophet_for(target, options.heads, options.draft_vocab)
        make = partial(ProphetDrafter, target, prophet)
    elif method == "eagle":
        from .eagle import EagleDrafter, load_eagle_head
        from .shapes import StaticTree

        head = load_eagle_head(target, options.heads, options.draft_vocab)
        make = partial(EagleDrafter, target, head, StaticTree((1,) * depth))
    else:
        raise ValueError(f"{method} is not a head method")
    return PerRowDrafter(make, max_batch_size, HEAD_BATCH_K[method])
