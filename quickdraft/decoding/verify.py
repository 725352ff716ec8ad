"""Acceptance rules: given a proposed token tree and the target's logits, keep one path.

Every rule walks down from the root, accepting at most one child per node, and returns
the accepted path plus the one token the target adds (the correction after a rejection,
or the bonus token after the path's last node), so a step yields between 1 and depth + 1
tokens. A chain is the tree with one child per node: the same code verifies both. The
rules see one sequence (one batch row), so a batched engine can apply them per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .proposal import Proposal
from .sampling import SamplingParams, argmax_ids, host_probabilities, sample


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one proposal.

    ``path`` lists the accepted nodes from the root down (indices into the proposal; for a
    chain always ``0 .. m-1``); ``next_token`` is the target's own token after them.
    """

    path: list[int]
    next_token: int

    @property
    def accepted(self) -> int:
        return len(self.path)


class AcceptanceRule(Protocol):
    """Verifies one proposal against the target's logits (``RULES`` names the sampling ones)."""

    def __call__(self, proposal: Proposal, target_logits: torch.Tensor) -> Verdict:
        """``target_logits`` ``[n + 1, V]``: row 0 scores the root's children, row ``i + 1``
        the children of node ``i`` (and the bonus token after a path ending at ``i``)."""


class GreedyAcceptance:
    """Follow the child equal to the target's argmax; then the target's argmax."""

    def __call__(self, proposal: Proposal, target_logits: torch.Tensor) -> Verdict:
        return self.follow(proposal, argmax_ids(target_logits))

    def follow(self, proposal: Proposal, choice: list[int]) -> Verdict:
        """The verdict from the target's argmax per row of its logits, already on the host
        (the batched engine reads every greedy row's at once)."""
        tokens = proposal.tokens.tolist()
        if proposal.is_chain:  # the common case, without building the child lists
            path = []
            while len(path) < len(tokens) and tokens[len(path)] == choice[len(path)]:
                path.append(len(path))
            return Verdict(path, choice[len(path)])
        kids = proposal.children()
        path, node = [], -1
        while True:
            want = choice[node + 1]
            node = next((c for c in kids.get(node, ()) if tokens[c] == want), None)
            if node is None:
                return Verdict(path, want)
            path.append(node)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)); falls back to p when the residual has no mass (p == q in floats)."""
    residual = (p - q).clamp_(min=0)
    total = residual.sum()
    return residual / total if total > 0 else p


def one_hot(token: int, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like).index_fill_(0, torch.tensor([token]), 1.0)


class SpeculativeSampling:
    """Multi-step speculative sampling (SpecInfer; Leviathan / Chen on a chain): output is
    distributed exactly as p.

    At each accepted node, try its children in turn: accept child x with probability
    min(1, p(x)/q(x)); after a rejection replace p by norm(max(p - q, 0)) and try the next;
    if every child fails, sample from the current p (after a full path: the bonus token).
    A deterministic drafter has q = one-hot, which the same formulas cover. Children that
    duplicate an earlier sibling were merged by the drafter: skipping a draw is exact
    because the later draws are independent of it.
    """

    def __init__(self, params: SamplingParams, generator: torch.Generator) -> None:
        self.params = params
        self.generator = generator

    def update(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """The target distribution for the next sibling after rejecting a draw from q."""
        return residual_distribution(p, q)

    def __call__(self, proposal: Proposal, target_logits: torch.Tensor) -> Verdict:
        # float32 on the CPU whatever the model's device and dtype: one copy of p per step.
        return self.decide(proposal, host_probabilities(target_logits, self.params, self.generator))

    def decide(self, proposal: Proposal, p_all: torch.Tensor) -> Verdict:
        """The rule on the target's distributions already on the host (``[size + 1, V]``,
        :func:`~.sampling.host_probabilities`): the batched engine copies every row's at once."""
        tokens = proposal.tokens.tolist()
        kids = proposal.children()
        path, node = [], -1
        while True:
            p = p_all[node + 1]
            for child in kids.get(node, ()):
                x = tokens[child]
                q = one_hot(x, p) if proposal.probs is None else proposal.probs[child]
                # u < p/q accepts, written without dividing by q.
                if float(torch.rand(1, generator=self.generator)) * float(q[x]) < float(p[x]):
                    break
                p = self.update(p, q)
            else:
                return Verdict(path, sample(p, self.generator))
            path.append(child)
            node = child


class SpecTrSampling:
    """SpecTr K-SEQ (Sun et al. 2023) over drafts sampled i.i.d. from q, merged in a tree.

    At a node reached by ``N`` drafts (their next tokens are N i.i.d. draws from q), take
    the draws in a uniformly random order (their original order, in distribution) and
    accept draw x with probability min(1, p(x) / (rho q(x))); the first accepted wins.
    With beta = sum_x min(q, p/rho), the chance that some draw is accepted is
    1 - (1 - beta)^N and the accepted token is distributed as min(q, p/rho) / beta, so
    if none is accepted sampling from
        r(x) = p(x) - min(q(x), p(x)/rho) (1 - (1 - beta)^N) / beta
    (normalised; total mass 1 - that chance) gives exactly p; r >= 0 iff
    1 - (1 - beta)^N <= rho beta. rho in [1, N] is the smallest with that property
    (most acceptance), found by grid refinement: rho beta(rho) is increasing, the left
    side decreasing in rho. For N = 1, rho = 1 and this is plain speculative sampling.
    """

    def __init__(self, params: SamplingParams, generator: torch.Generator) -> None:
        if params.greedy:
            raise ValueError(
                "--multi-draft-rule spectr needs sampling (--temperature > 0); greedy multi-draft "
                "already follows the target's argmax through the tree"
            )
        self.params = params
        self.generator = generator

    @staticmethod
    def solve_rho(p: torch.Tensor, q: torch.Tensor, n: int, rounds: int = 3) -> float:
        """The smallest feasible rho in [1, n], to within (n - 1) / 32^rounds (always a
        feasible one: exactness holds for any, the smallest accepts most)."""
        p64, q64 = p.double(), q.double()
        lo, hi = 1.0, float(n)
        for _ in range(rounds):  # a grid per round instead of a bisection step: fewer tensor ops
            rho = torch.linspace(lo, hi, 33, dtype=torch.float64)
            beta = torch.minimum(q64[None], p64[None] / rho[:, None]).sum(1)
            feasible = (1 - (1 - beta) ** n <= rho * beta).tolist()
            first = feasible.index(True) if True in feasible else 32  # rho = n is always feasible
            if first == 0:
                return float(rho[0])
            lo, hi = float(rho[first - 1]), float(rho[first])
        return hi

    def residual(self, p: torch.Tensor, q: torch.Tensor, rho: float, n: int) -> torch.Tensor:
        accepted = torch.minimum(q, p / rho)
        beta = float(accepted.sum())
        scale = (1 - (1 - beta) ** n) / beta if beta > 0 else 0.0
        return residual_distribution(p, accepted * scale)

    def __call__(self, proposal: Proposal, target_logits: torch.Tensor) -> Verdict:
        if proposal.size and proposal.probs is None:
            raise ValueError("SpecTr verifies sampled drafts; this drafter proposes deterministic tokens")
        p_all = host_probabilities(target_logits, self.params, self.generator)
        tokens = proposal.tokens.tolist()
        counts = [1] * proposal.size if proposal.counts is None else proposal.counts.tolist()
        kids = proposal.children()
        path, node = [], -1
        while True:
            p = p_all[node + 1]
            children = kids.get(node, [])
            if not children:
                return Verdict(path, sample(p, self.generator))
            q = proposal.probs[children[0]]
            draws = [c for c in children for _ in range(counts[c])]
            order = torch.randperm(len(draws), generator=self.generator).tolist()
            rho = self.solve_rho(p, q, len(draws))
            chosen = None
            for i in order:
                x = tokens[draws[i]]
                if float(torch.rand(1, generator=self.generator)) * rho * float(q[x]) < float(p[x]):
                    chosen = draws[i]
                    break
            if chosen is None:
                return Verdict(path, sample(self.residual(p, q, rho, len(draws)), self.generator))
            path.append(chosen)
            node = chosen


RULES = {"mss": SpeculativeSampling, "spectr": SpecTrSampling}


def acceptance_for(params: SamplingParams, generator: torch.Generator, rule: str = "mss") -> AcceptanceRule:
    """The lossless rule for the sampling mode: greedy, or ``rule`` (mss / spectr) when
    sampling. Greedy multi-draft is the greedy tree walk."""
    if rule not in RULES:
        raise ValueError(f"unknown acceptance rule {rule!r}; choose one of: {', '.join(RULES)}")
    if rule == "spectr" and params.greedy:
        RULES[rule](params, generator)  # raises the explanation
    return GreedyAcceptance() if params.greedy else RULES[rule](params, generator)
