"""When a chain drafter stops drafting (``--draft-stop``): a fixed k or an adaptive rule.

A policy is asked, at the start of every chain, for the most tokens to draft
(``max_depth(k)``, never more than the engine's ``k``: that bound keeps a step inside the
token budget and the verify width); after each drafted token, whether to draft another
(``keep_going``: the token just drafted is proposed either way); after each verification,
how many of the drafted tokens the target accepted (``observe``). Policies only change how
many tokens are proposed, never which ones, so every policy is lossless.

Policies keep their state across generations, as transformers' assistant schedule does: a
threshold adapted on one prompt is the starting point of the next.
"""

from __future__ import annotations

from typing import Protocol

import torch

#: The most tokens an adaptive policy drafts per step when no -k caps it (Draft & Verify's
#: max of 12 drafts); the fixed policy's k is chosen by the cost model instead.
ADAPTIVE_MAX_DEPTH = 12
#: How many numbers a policy's state takes in greedy rounds run in C (``rounds_state``; the
#: layout is ``qd_spec_rounds``' in models/kernels/layer_ops.c).
ROUNDS_STATE = 10


def rounds_state(kind: int, floor: float = 0.0, dv: tuple[float, ...] = (0.0,) * 6,
                 heuristic: tuple[float, float] = (-1.0, 0.0)) -> torch.Tensor:
    """A policy's state for greedy rounds in C: its kind (0 fixed, 1 confidence, 2 dv, 3
    heuristic), its confidence floor, dv's acceptance, target, eps, beta1, beta2 and most
    drafts, then heuristic's n (-1: unset) and the cap (dv's last, heuristic's largest k)."""
    return torch.tensor([kind, floor, *dv, *heuristic], dtype=torch.float64)


class StepCostTable(Protocol):
    """Measured step costs, as the ``cost`` policy weighs them (the policy layer's
    ``StepCosts`` is one; drafters sit below it and take the costs as data)."""

    overhead: float  # seconds per step outside the model calls

    def t_drafting(self, k: int) -> float:
        """Seconds of k consecutive draft steps within one speculative step."""

    def t_verify(self, n: int) -> float:
        """Seconds of one target pass over n tokens."""


class DraftStop(Protocol):
    """How many tokens a chain drafter drafts this step."""

    name: str
    #: Whether ``keep_going`` may end a chain before ``max_depth``: where it cannot, a
    #: drafter may draft the whole chain in one call (the C chains) and ask nothing per token.
    stops_mid_chain: bool

    @property
    def min_confidence(self) -> float | None:
        """Where ``keep_going`` is exactly "the draft's top-1 probability is at least this"
        (confidence, dv: the value for this chain), that value, so a C chain can apply it
        token by token in its call; None where the rule is anything else."""

    def max_depth(self, k: int) -> int:
        """Most tokens to draft this step (fixed: ``k``; never more than ``k``). Called once
        at the start of every chain."""

    def keep_going(self, depth: int, q: torch.Tensor) -> bool:
        """After drafting ``depth`` tokens, the last drawn from ``q`` (the draft's
        probabilities ``[V]``): False stops the chain (that last token is still proposed)."""

    def observe(self, drafted: int, accepted: int) -> None:
        """After each verification: ``accepted`` of the ``drafted`` tokens were accepted."""

    def rounds_state(self) -> torch.Tensor | None:
        """This policy's state for greedy rounds run in C (:func:`rounds_state`), which
        apply its ``max_depth``, floor and ``observe`` as it would; None where it weighs
        more than that (the rounds then go one at a time through Python)."""

    def take_rounds_state(self, state: torch.Tensor) -> None:
        """Its state after those rounds."""


def rounds_state_of(policy: DraftStop) -> torch.Tensor | None:
    """``policy.rounds_state()``, or None for a policy without one (one of the caller's own)."""
    state = getattr(policy, "rounds_state", None)
    return None if state is None else state()


class FixedStop:
    """Always ``k`` tokens (what every chain drafter did before adaptive stopping)."""

    name = "fixed"
    stops_mid_chain = False
    min_confidence = None

    def max_depth(self, k: int) -> int:
        return k

    def keep_going(self, depth: int, q: torch.Tensor) -> bool:
        return True

    def observe(self, drafted: int, accepted: int) -> None:
        pass

    def rounds_state(self) -> torch.Tensor:
        return rounds_state(0)

    def take_rounds_state(self, state: torch.Tensor) -> None:
        pass


class ConfidenceStop:
    """Stop when the draft's top-1 probability falls below ``threshold`` (llama.cpp's
    ``--draft-p-min``; Draft & Verify's fixed threshold). Like Draft & Verify, the
    unconfident token is still proposed (llama.cpp drops it): it costs one verify row and
    is accepted often enough to pay for it."""

    stops_mid_chain = True

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.name = f"confidence:{threshold:g}"

    @property
    def min_confidence(self) -> float:
        return self.threshold

    def max_depth(self, k: int) -> int:
        return k

    def keep_going(self, depth: int, q: torch.Tensor) -> bool:
        return float(q.max()) >= self.threshold

    def observe(self, drafted: int, accepted: int) -> None:
        pass

    def rounds_state(self) -> torch.Tensor:
        return rounds_state(1, self.threshold)

    def take_rounds_state(self, state: torch.Tensor) -> None:
        pass


class DraftVerifyStop:
    """Draft & Verify's adaptive draft exiting (Zhang et al. 2023, their reference code).

    Drafting stops when the draft's top-1 probability is below the threshold gamma. After
    each verification, with acceptance ratio AR = accepted / drafted::

        AR~ <- b1 AR~ + (1 - b1) AR                 (AR~ starts at 0)
        gamma~ = gamma + eps     if AR~ < AR_target  (too many rejections: stop sooner)
                 gamma           elif the chain hit its most tokens (cannot draft longer)
                 gamma - eps     otherwise           (room to draft longer)
        gamma <- b2 gamma + (1 - b2) gamma~
    """

    name = "dv"
    stops_mid_chain = True

    def __init__(self, target: float = 0.9, eps: float = 0.01, beta1: float = 0.5, beta2: float = 0.9,
                 start: float = 0.6, max_drafts: int = ADAPTIVE_MAX_DEPTH) -> None:
        self.target, self.eps, self.beta1, self.beta2 = target, eps, beta1, beta2
        self.max_drafts = max_drafts
        self.threshold = start
        self.acceptance = 0.0  # AR~, the smoothed acceptance ratio
        self._cap = max_drafts

    @property
    def min_confidence(self) -> float:
        return self.threshold

    def max_depth(self, k: int) -> int:
        self._cap = min(k, self.max_drafts)
        return self._cap

    def keep_going(self, depth: int, q: torch.Tensor) -> bool:
        return float(q.max()) >= self.threshold

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.acceptance = self.beta1 * self.acceptance + (1 - self.beta1) * accepted / drafted
        if self.acceptance < self.target:
            goal = self.threshold + self.eps
        elif drafted >= self._cap:
            goal = self.threshold
        else:
            goal = self.threshold - self.eps
        self.threshold = self.beta2 * self.threshold + (1 - self.beta2) * goal

    def rounds_state(self) -> torch.Tensor:
        return rounds_state(2, self.threshold, (self.acceptance, self.target, self.eps, self.beta1, self.beta2,
                                                self.max_drafts), (-1.0, self._cap))

    def take_rounds_state(self, state: torch.Tensor) -> None:
        self.threshold, self.acceptance, self._cap = float(state[1]), float(state[2]), int(state[9])


class HeuristicStop:
    """transformers' assisted-generation schedule (``num_assistant_tokens_schedule=
    "heuristic"``): draft n tokens; n += 2 after a step whose drafts were all accepted,
    n -= 1 (not below 1) otherwise. n starts at, and never exceeds, the engine's k."""

    name = "heuristic"
    stops_mid_chain = False
    min_confidence = None

    def __init__(self) -> None:
        self.current: int | None = None
        self._cap = 1

    def max_depth(self, k: int) -> int:
        if self.current is None:
            self.current = k
        self._cap = max(self._cap, k)
        return min(self.current, k)

    def keep_going(self, depth: int, q: torch.Tensor) -> bool:
        return True

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0 or self.current is None:
            return
        step = 2 if accepted == drafted else -1
        self.current = min(max(self.current + step, 1), self._cap)

    def rounds_state(self) -> torch.Tensor:
        return rounds_state(3, heuristic=(-1.0 if self.current is None else self.current, self._cap))

    def take_rounds_state(self, state: torch.Tensor) -> None:
        self.current = None if state[8] < 0 else int(state[8])
        self._cap = int(state[9])


class CostStop:
    """Keep drafting while the cost model says one more token pays for itself.

    The draft's top-1 probabilities stand in for acceptance: P_i, the chance that the first
    i drafts are all accepted, is the product of their confidences, and a step drafting d
    tokens is expected to emit E_d = 1 + sum_{i<=d} P_i tokens in T_d = drafting(d) +
    verify(d + 1) seconds (a :class:`StepCostTable`). One more token adds about P_d * c_d tokens (c_d
    the last confidence) for T_{d+1} - T_d seconds; it is drafted when that raises the
    step's rate, i.e. when dE / dT > E_d / T_d.
    """

    name = "cost"
    stops_mid_chain = True
    min_confidence = None  # its rule weighs costs too

    def __init__(self, costs: StepCostTable | None = None, max_drafts: int = ADAPTIVE_MAX_DEPTH) -> None:
        self.costs, self.max_drafts = costs, max_drafts
        self._reach = 1.0  # P_d
        self._expected = 1.0  # E_d

    def max_depth(self, k: int) -> int:
        self._reach, self._expected = 1.0, 1.0
        return min(k, self.max_drafts)

    def _time(self, drafted: int) -> float:
        costs = self.costs
        return costs.t_drafting(drafted) + costs.t_verify(drafted + 1) + costs.overhead

    def keep_going(self, depth: int, q: torch.Tensor) -> bool:
        if self.costs is None:
            raise ValueError("the cost draft-stop policy needs measured step costs (CostStop(costs))")
        confidence = float(q.max())
        self._reach *= confidence
        self._expected += self._reach
        gain = self._reach * confidence
        extra = self._time(depth + 1) - self._time(depth)
        if extra <= 0:
            return gain > 0
        return gain / extra > self._expected / self._time(depth)

    def observe(self, drafted: int, accepted: int) -> None:
        pass

    def rounds_state(self) -> None:
        return None  # it weighs measured costs: round by round

    def take_rounds_state(self, state: torch.Tensor) -> None:
        pass


POLICIES = "fixed, confidence:T (0 < T < 1), dv, heuristic or cost"


def parse_draft_stop(text: str) -> DraftStop:
    """A policy from its ``--draft-stop`` spec: ``fixed``, ``confidence:T``, ``dv`` (with
    optional ``dv:target=0.9,eps=0.01,beta1=0.5,beta2=0.9,start=0.6,max=12``),
    ``heuristic`` or ``cost``; a one-line ValueError otherwise."""
    spec = text.strip().lower()
    name, _, arg = spec.partition(":")
    if name == "fixed" and not arg:
        return FixedStop()
    if name == "heuristic" and not arg:
        return HeuristicStop()
    if name == "cost" and not arg:
        return CostStop()
    if name == "confidence":
        try:
            threshold = float(arg)
        except ValueError:
            threshold = -1.0
        if not 0 < threshold < 1:
            raise ValueError(f"--draft-stop {text!r}: confidence needs a threshold in (0, 1), e.g. confidence:0.6")
        return ConfidenceStop(threshold)
    if name == "dv":
        stop = DraftVerifyStop(**_dv_settings(text, arg))
        stop.name = spec.replace(" ", "")
        return stop
    raise ValueError(f"--draft-stop {text!r} is not a policy; choose {POLICIES}")


def _dv_settings(text: str, arg: str) -> dict:
    keys = {"target": "target", "eps": "eps", "beta1": "beta1", "beta2": "beta2", "start": "start",
            "max": "max_drafts"}
    settings: dict = {}
    for item in filter(None, arg.split(",")):
        key, _, value = item.partition("=")
        try:
            number = int(value) if key == "max" else float(value)
        except ValueError:
            number = None
        if key not in keys or number is None or number < (1 if key == "max" else 0):
            raise ValueError(
                f"--draft-stop {text!r}: dv settings are key=value among target, eps, beta1, beta2, "
                "start (numbers >= 0) and max (an integer >= 1), e.g. dv:target=0.8,max=8"
            )
        settings[keys[key]] = number
    return settings
