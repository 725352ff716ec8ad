"""A smaller model with the same tokenizer drafts k tokens autoregressively."""

from __future__ import annotations

import torch

from ..models.lm import CausalLM
from ..sampling import SamplingParams, choose
from .base import Proposal


class DraftModelDrafter:
    """Leviathan / Chen speculative decoding's drafter.

    The draft keeps its own KV cache. Its last proposal is never fed to it (nothing needs its
    logits), so after a full acceptance the next ``propose`` feeds two tokens at once (that
    proposal and the target's bonus token): the catch-up costs no extra pass.
    """

    name = "draft"

    def __init__(self, model: CausalLM, target_vocab_size: int) -> None:
        self.model = model
        self.vocab_size = target_vocab_size
        self.params = SamplingParams()
        self.generator = torch.Generator()

    def start(self, prompt: torch.Tensor, params: SamplingParams, generator: torch.Generator, max_len: int) -> None:
        self.params, self.generator = params, generator
        self.model.reset(max_len)
        if prompt.shape[0] > 1:
            self.model.extend(prompt[:-1], logits="none")

    def _logits(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.model.extend(tokens, logits="last")[-1]
        # Same tokenizer, padded vocabularies may differ: present logits over the target's ids.
        size = logits.shape[0]
        if size > self.vocab_size:
            return logits[: self.vocab_size]
        if size < self.vocab_size:
            return torch.cat([logits, logits.new_full((self.vocab_size - size,), float("-inf"))])
        return logits

    def propose(self, sequence: torch.Tensor, k: int) -> Proposal:
        logits = self._logits(sequence[self.model.length :])
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for i in range(k):
            token, dist = choose(logits, self.params, self.generator)
            tokens.append(token)
            if dist is not None:
                probs.append(dist)
            if i + 1 < k:
                logits = self._logits(torch.tensor([token]))
        return Proposal(torch.tensor(tokens, dtype=torch.long), torch.stack(probs) if probs else None)

    def verified(self, n_valid: int) -> None:
        self.model.crop(n_valid)
