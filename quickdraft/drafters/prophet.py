"""``--method prophet``: a prophet transformer (:mod:`quickdraft.models.prophet`) drafts a
chain from the target's final hidden states of the last ``n_start`` tokens it accepted.

Each round starts the prophet's cache afresh: one pass over ``[states, newest token]`` at
positions ``0 .. n``, then one pass per drafted token, exactly the sequence it was trained
on. The chain goes to the engine's chain verification like a draft model's, with ``q``
(the distribution each token was drawn from) when sampling, so the exact rule keeps the
output distributed as the target's: lossless.

The states come from the contract of drafters that read the target
(:mod:`quickdraft.decoding.drafter`): after each verify pass the engine hands the states
of the tokens just accepted, never those of rejected drafts (the source fed the verify
pass's last state, a rejected draft's whenever one was rejected), and the last of them is
the state of the token before the newest one.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ..decoding.drafter import EMPTY, Proposal, check_single_slot
from ..decoding.sampling import SamplingParams, choose
from ..models.decode_linear import row_dependent_rounding
from ..models.lm import HIDDEN_STATES_NEED_NATIVE, CausalLM, NativeLM
from ..models.prophet import FILES as PROPHET_FILES
from ..models.prophet import Prophet, ProphetConfig, load_prophet
from .shipped import shipped_for


class ProphetDrafter:
    """Drafts a chain with a prophet (batch 1, slot 0)."""

    name = "prophet"

    def __init__(self, target: NativeLM, prophet: Prophet) -> None:
        if not isinstance(target, NativeLM):
            raise ValueError(HIDDEN_STATES_NEED_NATIVE)
        self.prophet, self.n = prophet, prophet.config.n_start
        self.reads_hidden = (target.config.n_layers,)
        # The decoder as a draft LM of its own (its KV cache, the decode kernels).
        self.lm = NativeLM(prophet.decoder)
        self.max_depth = prophet.config.max_positions - self.n - 1
        self.params, self.generator = SamplingParams(), torch.Generator()
        self._states: torch.Tensor | None = None  # the last n accepted tokens' states

    def verify_width(self, k: int) -> int:
        return min(k, self.max_depth) + 1

    def join(self, slot: int, prompt: torch.Tensor, params: SamplingParams, generator: torch.Generator,
             max_len: int) -> None:
        check_single_slot(self, slot)
        self.params, self.generator = params, generator
        self._states = None

    def observe(self, slot: int, start: int, states: dict[int, torch.Tensor]) -> None:
        new = states[self.reads_hidden[0]]
        self._states = (new if self._states is None else torch.cat([self._states, new]))[-self.n :]

    @torch.inference_mode()
    def propose(self, slots: Sequence[int], sequences: Sequence[torch.Tensor], ks: Sequence[int]) -> list[Proposal]:
        k = min(ks[0], self.max_depth)
        if k == 0 or self._states is None or self._states.shape[0] < self.n:  # too few tokens accepted yet: a plain step
            return [EMPTY]
        return [self._draft(sequences[0][-1:], k)]

    # The prophet's numerics never change what the target accepts (greedy) and sampled
    # output stays exact whatever q is: take the fastest one-row kernels.
    @row_dependent_rounding()
    def _draft(self, newest: torch.Tensor, k: int) -> Proposal:
        self.lm.reset(self.n + k)  # the cache restarts each round
        x = self.prophet.inputs(self._states[None].to(self.lm.model.embed.weight.dtype),
                                newest[None].to(self._states.device))[0]
        logits = self._feed(torch.zeros(x.shape[0], dtype=torch.long), x)
        tokens, probs = [], []
        for i in range(k):
            token, q = choose(logits[-1], self.params, self.generator)
            tokens.append(token)
            probs.append(q)
            if i + 1 < k:
                logits = self._feed(torch.tensor([token]))
        sampled = probs[0] is not None
        return Proposal.chain(torch.tensor(tokens, dtype=torch.long), torch.stack(probs) if sampled else None)

    def _feed(self, tokens: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Feed the prophet ``tokens`` (or, with ``hidden``, that input stream: then only
        the count of ``tokens`` matters) at the positions after its cache; last logits."""
        return self.lm.extend(tokens, logits="last", hidden=hidden)

    def verified(self, slot: int, length: int, path: list[int]) -> None:
        pass  # nothing to roll back: the next round starts afresh from observe's states

    def leave(self, slot: int) -> None:
        self._states = None


def shipped_prophet(target: CausalLM) -> Path | None:
    """The prophet packaged for this target, if any."""
    return next(iter(shipped_for(target, PROPHET_FILES, ProphetConfig)), None)


def load_prophet_for(target: CausalLM | None, heads: str | Path | Prophet | None,
                     draft_vocab: int | None = None) -> Prophet:
    """``heads`` as a loaded prophet for ``target``: loaded already (as it is), a directory,
    or (None) the prophet shipped for the target; a one-line error when there is none.
    ``draft_vocab``: how many of its most frequent tokens it scores (``load_prophet``)."""
    if not isinstance(target, NativeLM):
        raise ValueError(HIDDEN_STATES_NEED_NATIVE)
    if isinstance(heads, Prophet):
        return heads
    path = heads or shipped_prophet(target)
    if path is None:
        raise ValueError("--method prophet needs a prophet for this target: pass --heads DIR (train one with "
                         "`quickdraft train heads --kind prophet --target ...`)")
    return load_prophet(path, target.model, draft_vocab)
