"""Acceptance rules: given the drafter's proposals and the target's logits, keep a prefix.

Every rule returns how many proposals it accepted and the one token the target adds
(the correction after a rejection, or the bonus token after a full acceptance), so a
step always yields between 1 and k+1 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .sampling import SamplingParams, probabilities, sample


@dataclass(frozen=True)
class Verdict:
    accepted: int  # number of proposals kept (a prefix)
    next_token: int  # the target's own token after them


class AcceptanceRule(Protocol):
    lossless: bool

    def __call__(
        self, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_logits: torch.Tensor
    ) -> Verdict:
        """``draft_tokens`` ``[k]``, ``draft_probs`` ``[k, V]`` (None: deterministic drafter),
        ``target_logits`` ``[k+1, V]`` (position i scores proposal i; the last is the bonus)."""


class GreedyAcceptance:
    """Keep the longest prefix equal to the target's argmax, then the target's argmax."""

    lossless = True

    def __call__(
        self, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_logits: torch.Tensor
    ) -> Verdict:
        choice = target_logits.argmax(dim=-1)
        k = draft_tokens.shape[0]
        if k == 0:
            return Verdict(0, int(choice[0]))
        mismatch = (draft_tokens != choice[:k]).tolist()
        accepted = mismatch.index(True) if True in mismatch else k
        return Verdict(accepted, int(choice[accepted]))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)); falls back to p when the residual has no mass (p == q in floats)."""
    residual = (p - q).clamp_(min=0)
    total = residual.sum()
    return residual / total if total > 0 else p


class SpeculativeSampling:
    """Leviathan et al. / Chen et al. rejection sampling: output is distributed exactly as p.

    Accept proposal x with probability min(1, p(x)/q(x)); at the first rejection sample from
    norm(max(p - q, 0)); if all are accepted sample the bonus token from p. A deterministic
    drafter has q = one-hot, which the same formulas cover.
    """

    lossless = True

    def __init__(self, params: SamplingParams, generator: torch.Generator) -> None:
        self.params = params
        self.generator = generator

    def __call__(
        self, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_logits: torch.Tensor
    ) -> Verdict:
        p = probabilities(target_logits, self.params)
        k = draft_tokens.shape[0]
        if k == 0:
            return Verdict(0, sample(p[0], self.generator))
        if draft_probs is None:
            q = torch.zeros_like(p[:k]).scatter_(1, draft_tokens[:, None], 1.0)
        else:
            q = draft_probs
        idx = torch.arange(k)
        p_x, q_x = p[idx, draft_tokens], q[idx, draft_tokens]
        u = torch.rand(k, generator=self.generator)
        rejected = (u * q_x >= p_x).tolist()  # u < p/q accepts, written without dividing by q
        if True not in rejected:
            return Verdict(k, sample(p[k], self.generator))
        i = rejected.index(True)
        return Verdict(i, sample(residual_distribution(p[i], q[i]), self.generator))


def acceptance_for(params: SamplingParams, generator: torch.Generator) -> AcceptanceRule:
    """The lossless rule matching the sampling mode."""
    return GreedyAcceptance() if params.greedy else SpeculativeSampling(params, generator)
