"""The speculative-decoding cost model (docs/methods.md, "Cost model").

Pure functions, no torch. Notation:

- ``alpha``: the i.i.d. acceptance probability of one draft token;
- ``a_i`` (``per_position``): P(draft position i is accepted), i.e. P(at least i+1 of the
  step's proposals are accepted), as :attr:`GenerationStats.per_position_acceptance`
  measures it. Under the i.i.d. model ``a_i = alpha ** (i + 1)``;
- tau(k): expected tokens emitted per target pass with k proposals = 1 + sum_{i<k} a_i
  (the target always adds one token); with i.i.d. acceptance
  ``(1 - alpha ** (k + 1)) / (1 - alpha)``;
- step costs (seconds): ``t_ar`` one plain decode step of the target (1 token),
  ``t_draft`` one draft step, ``t_verify(n)`` one target pass over n tokens, and an
  optional per-step ``overhead`` (bookkeeping outside the model calls).

predicted speedup(k) = tau(k) * (t_ar + overhead_ar) / (k * t_draft + t_verify(k+1) + overhead)

(``k * t_draft`` is replaced by the measured time of k consecutive draft steps when
:attr:`StepCosts.draft_burst` has it.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

MAX_K = 16


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """tau for i.i.d. acceptance ``alpha`` and ``k`` proposals: (1 - alpha^(k+1)) / (1 - alpha)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_tokens_from_acceptance(per_position: Sequence[float], k: int | None = None) -> float:
    """tau = 1 + sum of the first ``k`` per-position acceptances (all of them when k is None).

    ``per_position[i]`` is P(position i accepted) (cumulative by construction: position i
    can only be accepted when positions 0..i-1 were). When ``k`` exceeds the measured
    positions the tail is extrapolated with :func:`extend_acceptance`.
    """
    values = list(per_position) if k is None else extend_acceptance(per_position, k)
    return 1.0 + sum(values)


def extend_acceptance(per_position: Sequence[float], k: int) -> list[float]:
    """The first ``k`` per-position acceptances; beyond the measured ones the tail decays
    geometrically with the conditional acceptance of the last measured positions
    (a_{i+1} / a_i, averaged over up to 3 of them; the fitted alpha if none is defined)."""
    values = [min(max(float(a), 0.0), 1.0) for a in per_position]
    # Cumulative probabilities cannot increase with position; measurement noise can.
    for i in range(1, len(values)):
        values[i] = min(values[i], values[i - 1])
    if k <= len(values):
        return values[:k]
    if not values:
        return [0.0] * k
    ratios = [values[i + 1] / values[i] for i in range(len(values) - 1) if values[i] > 0]
    ratio = sum(ratios[-3:]) / len(ratios[-3:]) if ratios else values[0]
    out = list(values)
    while len(out) < k:
        out.append(out[-1] * ratio)
    return out


@dataclass
class StepCosts:
    """Measured seconds of the model calls one step is made of.

    ``verify[n]`` is one target pass over n tokens (``verify[1]`` = ``t_ar``); sizes not
    measured are interpolated linearly (extrapolated from the two largest measured).
    ``overhead`` is per-step time outside the model calls of a speculative step,
    ``overhead_ar`` the same for a plain step (both default to 0). ``draft_burst[j]``
    (optional, measured) is the time of j consecutive draft steps right after a target
    pass; when given it replaces ``j * t_draft`` (on a CPU the first draft step after a
    target pass is slower: the target evicted the draft's weights from the caches).
    """

    t_ar: float
    t_draft: float
    verify: dict[int, float] = field(default_factory=dict)
    overhead: float = 0.0
    overhead_ar: float = 0.0
    draft_burst: dict[int, float] = field(default_factory=dict)

    def t_drafting(self, k: int) -> float:
        """Seconds of k draft steps within one speculative step."""
        if k in self.draft_burst:
            return self.draft_burst[k]
        if self.draft_burst:
            top = max(self.draft_burst)
            if k > top:
                return self.draft_burst[top] + (k - top) * self.t_draft
        return k * self.t_draft

    def t_verify(self, n: int) -> float:
        table = dict(self.verify)
        table.setdefault(1, self.t_ar)
        if n in table:
            return table[n]
        sizes = sorted(table)
        if n < sizes[0]:
            return table[sizes[0]]
        below = [s for s in sizes if s < n]
        above = [s for s in sizes if s > n]
        if above:
            lo, hi = below[-1], above[0]
        elif len(sizes) >= 2:
            lo, hi = sizes[-2], sizes[-1]
        else:
            return table[sizes[0]]
        slope = (table[hi] - table[lo]) / (hi - lo)
        return table[lo] + slope * (n - lo)

    def to_dict(self) -> dict:
        return {
            "t_ar": self.t_ar,
            "t_draft": self.t_draft,
            "t_verify": {str(n): v for n, v in sorted(self.verify.items())},
            "overhead": self.overhead,
            "overhead_ar": self.overhead_ar,
            "draft_burst": {str(n): v for n, v in sorted(self.draft_burst.items())},
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> StepCosts:
        return cls(
            t_ar=float(d["t_ar"]),
            t_draft=float(d["t_draft"]),
            verify={int(n): float(v) for n, v in d.get("t_verify", {}).items()},
            overhead=float(d.get("overhead", 0.0)),
            overhead_ar=float(d.get("overhead_ar", 0.0)),
            draft_burst={int(n): float(v) for n, v in d.get("draft_burst", {}).items()},
        )


def step_time(costs: StepCosts, k: int) -> float:
    """Modelled seconds of one speculative step with k proposals."""
    return costs.t_drafting(k) + costs.t_verify(k + 1) + costs.overhead


def predicted_speedup(
    k: int,
    costs: StepCosts,
    alpha: float | None = None,
    per_position: Sequence[float] | None = None,
) -> float:
    """E * T_ar / (k * T_draft + T_verify(k+1)) (+ per-step overheads when given).

    E comes from ``per_position`` (measured; extrapolated past its length) when given,
    else from ``alpha``.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if per_position is not None:
        tau = expected_tokens_from_acceptance(per_position, k)
    elif alpha is not None:
        tau = expected_tokens_per_step(alpha, k)
    else:
        raise ValueError("give alpha or per_position")
    return tau * (costs.t_ar + costs.overhead_ar) / step_time(costs, k)


def speedup_curve(
    costs: StepCosts,
    alpha: float | None = None,
    per_position: Sequence[float] | None = None,
    max_k: int = MAX_K,
) -> dict[int, float]:
    """Predicted speedup for every k in 1..max_k."""
    return {k: predicted_speedup(k, costs, alpha, per_position) for k in range(1, max_k + 1)}


def best_k(
    costs: StepCosts,
    alpha: float | None = None,
    per_position: Sequence[float] | None = None,
    max_k: int = MAX_K,
) -> int:
    """The k in 1..max_k with the highest predicted speedup (the smallest one on ties)."""
    curve = speedup_curve(costs, alpha, per_position, max_k)
    return max(curve, key=lambda k: (round(curve[k], 12), -k))


def choose_k(
    costs: StepCosts,
    alpha: float | None = None,
    per_position: Sequence[float] | None = None,
    max_k: int = MAX_K,
    min_gain: float = 1.0,
) -> int:
    """The k to decode with: :func:`best_k`, or 0 (do not speculate) when even the best k is
    predicted to be no faster than plain decoding times ``min_gain``."""
    k = best_k(costs, alpha, per_position, max_k)
    return k if predicted_speedup(k, costs, alpha, per_position) > min_gain else 0


def where_time_goes(costs: StepCosts, k: int, measured_step_seconds: float | None = None) -> dict:
    """A breakdown of one speculative step: drafting, verification, and (given the measured
    step time) the rest, which is Python and bookkeeping overhead."""
    draft = costs.t_drafting(k)
    verify = costs.t_verify(k + 1)
    out = {"k": k, "draft_seconds": draft, "verify_seconds": verify, "model_seconds": draft + verify}
    if measured_step_seconds is not None:
        out["measured_step_seconds"] = measured_step_seconds
        out["overhead_seconds"] = measured_step_seconds - draft - verify
        total = max(measured_step_seconds, 1e-12)
        out["shares"] = {
            "draft": draft / total,
            "verify": verify / total,
            "overhead": max(measured_step_seconds - draft - verify, 0.0) / total,
        }
    return out


__all__ = [
    "MAX_K",
    "StepCosts",
    "best_k",
    "choose_k",
    "expected_tokens_from_acceptance",
    "expected_tokens_per_step",
    "extend_acceptance",
    "predicted_speedup",
    "speedup_curve",
    "step_time",
    "where_time_goes",
]
