"""How many draft tokens per row a batch should use (docs/batching.md, "Policy").

With more rows a verify pass stops being memory-bound: a pass over ``B`` rows of ``k + 1``
tokens costs more than one over ``B`` rows of 1 token, and more so as ``B`` grows, and
as the rows' contexts grow (attention over the cache). The policy measures the target's
ragged pass for every (batch, width) and the drafter's batched step per batch size (the
draft model's, or early exit's first layers + head) at two contexts (``CONTEXTS``), once
per model pair and machine (cached next to the auto-k choices). Per step the cost model
(``cost_model.choose_k``) picks k for the current number of rows and their mean length
(costs interpolated between the two contexts) from the acceptance measured so far; k = 0
(plain decoding) when no k is predicted to beat batched plain decoding by ``MIN_GAIN``
(by ``LONE_ROW_MIN_GAIN`` for a lone row, as ``generate`` decides).
"""

from __future__ import annotations

import statistics
import sys
from collections import deque
from collections.abc import Sequence

import torch

from ..decoding.stats import GenerationStats, RecentAcceptance
from ..models.ragged import Feed, ragged_forward
from . import cache as policy_cache
from . import timing
from .cost_model import StepCosts, choose_k

#: Acceptance by position assumed until the batch has drafted ``MIN_DRAFTED`` tokens.
PRIOR_ACCEPTANCE = [0.75, 0.6, 0.5, 0.42, 0.36, 0.3, 0.26, 0.22]
MIN_DRAFTED = 64
#: Speculate only when predicted to be at least this much faster than plain decoding: the
#: margin covers the per-row bookkeeping of a speculative step the cost model leaves out.
MIN_GAIN = 1.1
#: A lone row drafts and verifies with ``generate``'s own kernels (``drafters/batched``), so
#: it speculates whenever ``generate`` would: when predicted faster than plain decoding at all.
LONE_ROW_MIN_GAIN = 1.0
WIDTHS = (1, 2, 3, 4, 5, 7, 9)
#: Row lengths the costs are measured at; the policy interpolates between them (and
#: extrapolates past the last: attention grows linearly with the context).
CONTEXTS = (256, 1024)
CACHE_VERSION = 5  # 3: packed ragged passes (session 10); 4: keyed by policy.cache; 5: lone-row draft kernels


def batch_sizes(max_batch_size: int) -> list[int]:
    return sorted({b for b in (1, 2, 4, 8, 16, 32) if b <= max_batch_size} | {max_batch_size})


def _interpolate(table: dict[int, float], x: int) -> float:
    keys = sorted(table)
    if x in table:
        return table[x]
    lo = max([k for k in keys if k < x], default=keys[0])
    hi = min([k for k in keys if k > x], default=keys[-1])
    if lo == hi:
        return table[lo]
    return table[lo] + (table[hi] - table[lo]) * (x - lo) / (hi - lo)


def measure_batch_costs(model, cache, drafter=None, sizes: Sequence[int] = (1,),
                        widths: Sequence[int] = WIDTHS, repeats: int = 3,
                        contexts: Sequence[int] = CONTEXTS) -> dict:
    """``{"calibrations": [{"context", "verify", "draft"}, ...]}``: per context (tokens per
    row; capped by the caches' length), the median seconds of a target ragged pass per
    (batch, width) and of a batched 1-token step of ``drafter`` (a ``BatchedChain``: the
    draft model or early exit) per batch size; ``"spread"``: how noisy the timings were
    (:func:`.timing.spread_of`)."""
    vocab = model.config.vocab_size
    room = min([cache.max_len] + ([drafter.cache.max_len] if drafter is not None else []))
    cap = max(1, room - max(widths) - 1)
    samples: list[list[float]] = []
    calibrations = [_measure_at(model, cache, drafter, sizes, widths, repeats, context, vocab, samples)
                    for context in sorted({min(c, cap) for c in contexts})]
    return {"calibrations": calibrations, "spread": timing.spread_of(samples)}


def _measure_at(model, cache, drafter, sizes, widths, repeats, context: int, vocab: int,
                samples: list[list[float]]) -> dict:
    ids = torch.arange(context + max(widths)) % vocab
    perf = timing.clock

    def target(feeds):
        return ragged_forward(model, cache, feeds)

    def timed(forward, feeds) -> float:
        forward(feeds)  # warm
        times = []
        for _ in range(repeats):
            started = perf()
            forward(feeds)
            times.append(perf() - started)
        samples.append(times)
        return statistics.median(times)

    verify: dict[str, dict[str, float]] = {}
    draft: dict[str, float] = {}
    for row in range(max(sizes)):  # each row holds the context (timed passes write past it)
        target([Feed(row, 0, ids[:context], 0)])
        if drafter is not None:
            drafter.forward([Feed(row, 0, ids[:context], 0)])
    for b in sizes:
        verify[str(b)] = {str(w): timed(target, [Feed(r, context, ids[context: context + w], w) for r in range(b)])
                          for w in widths}
        if drafter is not None:
            draft[str(b)] = timed(drafter.forward, [Feed(r, context, ids[context: context + 1], 1) for r in range(b)])
    return {"context": context, "verify": verify, "draft": draft}


def _no_dearer_than_larger(costs: dict[int, float]) -> dict[int, float]:
    """Each cost capped by the costs of every larger size: a pass over fewer tokens (rows)
    costs no more than one over more, so a value above a larger size's is a timing
    disturbed by the machine (a shared CPU only ever adds time). One such outlier (a
    7-token pass at 11.2 ms between 6.1 ms for 9 and 5.5 ms for 5) skewed the policy."""
    out, cap = {}, float("inf")
    for size in sorted(costs, reverse=True):
        cap = min(cap, costs[size])
        out[size] = cap
    return dict(sorted(out.items()))


class _Calibration:
    """Costs measured at one context: target pass per (batch, width), draft step per batch
    (cleaned: never dearer than a larger width or batch)."""

    def __init__(self, table: dict) -> None:
        self.context = int(table.get("context", 0))
        verify = {int(b): _no_dearer_than_larger({int(w): t for w, t in ws.items()})
                  for b, ws in table["verify"].items()}
        for w in {w for ws in verify.values() for w in ws}:
            across = _no_dearer_than_larger({b: ws[w] for b, ws in verify.items() if w in ws})
            for b, t in across.items():
                verify[b][w] = t
        self.verify = verify
        self.draft = _no_dearer_than_larger({int(b): t for b, t in table.get("draft", {}).items()})

    def costs(self, rows: int) -> StepCosts:
        widths = sorted({w for ws in self.verify.values() for w in ws})
        verify = {w: _interpolate({b: ws[w] for b, ws in self.verify.items() if w in ws}, rows) for w in widths}
        t_draft = _interpolate(self.draft, rows) if self.draft else 0.0
        return StepCosts(t_ar=verify[1], t_draft=t_draft, verify=verify)


class LoneRowK:
    """k by whether a row decodes alone: ``lone`` for one row, ``crowded`` for more; no
    measurement. hybrid-eagle's batched rows take it (``lone`` its k, ``crowded`` its EAGLE
    chain): a lone row's prompt lookup proposes as many tokens as ``generate``'s does, but
    with several rows the verify pass is compute-bound and longer lookups cost more than
    they earn (SmolLM2, 4 rows of the bench's code prompts, one run per k: hybrid-eagle k =
    2 / 4 / 6 made 1.45 / 1.09 / 1.07x batched plain decoding, chats 0.97 / 1.04 / 0.78x;
    one row 2.00 / 2.71 / 1.94x and 1.43 / 1.56 / 1.21x; docs/batching.md)."""

    def __init__(self, lone: int, crowded: int) -> None:
        self.lone, self.crowded = lone, crowded

    def k(self, rows: int, pooled: GenerationStats | RecentAcceptance | None = None,
          context: int | None = None) -> int:
        return self.lone if rows <= 1 else self.crowded


#: What :class:`PlainWhenFaster` keeps per number of rows: the times of its last
#: ``SWITCH_TIMES`` steps of each kind (a ratio of two medians: one slow step on a busy
#: machine moves neither), the tokens of its last ``SWITCH_WINDOW`` drafting steps counted
#: within ``SWITCH_HORIZON`` steps of now (else the latest: acceptance follows the content,
#: chats then code); how often it takes two steps of the kind it is not using (every
#: ``EXPLORE_EVERY``, 1/16 of the steps at the slower kind; four times as often where the
#: two are within ``CLOSE`` of each other, where a wrong choice costs little a step but
#: one or two explored steps say little). Each kind is timed ``SWITCH_FIRST`` times first.
#: Drafting, once chosen, stops only when the gain falls below ``STAY``.
SWITCH_TIMES = 16
SWITCH_FIRST = 2
SWITCH_WINDOW = 32
EXPLORE_EVERY = 32
CLOSE = 1.15
STAY = 0.9
SWITCH_HORIZON = 2 * EXPLORE_EVERY


class PlainWhenFaster:
    """With several rows, speculate only while the engine's own steps say it pays.

    The head methods' rows (EAGLE, Medusa, prophet, hybrid-eagle) draft a fixed k: their
    drafters are per row, with no batched draft step a cost model could time, and the
    target's passes timed alone priced a crowded 3-token pass at 1.84 plain ones, more
    than the engine's rounds pay (docs/batching.md). So this policy prices the engine's
    own steps, per number of rows (steps of 5 and of 8 rows are not alike): a drafting
    step (k from ``inner``: an int, or a policy such as :class:`LoneRowK`) pays when its
    tokens per row, counted over the recent drafting steps, exceed the median time of
    such a step over the median time of a plain one (:meth:`gain`). Tokens are the
    content's (no clock in them) and move with it; the two times are the machine's and
    barely move, so they are medians over many steps, proof against a busy machine's
    slow steps. Every ``explore_every`` steps (a quarter as many where the gain is within
    :data:`CLOSE` of 1) it takes two steps of the kind it is not using, so both figures
    stay fresh; once drafting, it stops only below a gain of :data:`STAY`, so a shallow
    dip does not leave it plain for ``explore_every`` steps. A drafting step after a plain one is not timed: its drafters catch up on
    the tokens they did not see (EAGLE feeds them), which steady drafting does not pay.
    Each kind is timed ``first`` times first. A lone row takes ``inner``'s k unchanged: alone, the settled
    k is what ``generate`` measured to pay. The engine reports each step with
    :meth:`observe` (steps with a joining row's prefill are left out). Greedy output is
    plain decoding's whatever k a step runs."""

    def __init__(self, inner: int | LoneRowK, window: int = SWITCH_WINDOW, explore_every: int = EXPLORE_EVERY,
                 horizon: int = SWITCH_HORIZON, times: int = SWITCH_TIMES, first: int = SWITCH_FIRST) -> None:
        self.inner = inner
        self.window, self.explore_every, self.horizon, self.times = window, explore_every, horizon, times
        self.first = max(1, first)
        # rows -> seconds of its last steps of each kind (speculative: True), and
        # rows -> (step number, tokens per row) of its last drafting steps
        self._seconds: dict[tuple[int, bool], deque[float]] = {}
        self._tokens: dict[int, deque[tuple[int, float]]] = {}
        self._asked: dict[int, int] = {}  # steps asked for per number of rows
        self._kinds = (True, True)  # whether the step before last and the last one drafted
        self._drafting: dict[int, bool] = {}  # per number of rows: the kind chosen last (not explored)

    def k(self, rows: int, pooled: GenerationStats | RecentAcceptance | None = None,
          context: int | None = None) -> int:
        k = self.inner if isinstance(self.inner, int) else self.inner.k(rows, pooled, context)
        if rows > 1 and k > 0 and not self.speculates(rows):
            k = 0
        self._kinds = (self._kinds[1], k > 0)
        return k

    def gain(self, rows: int) -> float | None:
        """Tokens per second of a drafting step over a plain one with ``rows`` rows, from
        the steps kept (None until both kinds were timed)."""
        spec, plain, kept = self._seconds.get((rows, True)), self._seconds.get((rows, False)), self._tokens.get(rows)
        if not spec or not plain or not kept:
            return None
        now = self._asked.get(rows, 0)
        recent = [t for at, t in kept if now - at < self.horizon] or [kept[-1][1]]
        return statistics.fmean(recent) * statistics.median(plain) / statistics.median(spec)

    def speculates(self, rows: int) -> bool:
        """Whether the next step with ``rows`` rows drafts (each call counts as a step)."""
        asked = self._asked[rows] = self._asked.get(rows, 0) + 1
        if len(self._seconds.get((rows, True), ())) < self.first:  # each kind's first steps
            return True
        if len(self._seconds.get((rows, False), ())) < self.first:
            return False
        gain = self.gain(rows)
        # Drafting stops below STAY, not at 1: a gain's dips (a stretch of prose among code)
        # left plain steps for EXPLORE_EVERY steps where drafting pays (SmolLM2's code at 8
        # rows: 15-18% of the steps plain against 9-10% with it).
        better = gain is None or gain >= (STAY if self._drafting.get(rows, True) else 1)
        self._drafting[rows] = better
        close = gain is not None and 1 / CLOSE < gain < CLOSE
        every = max(4, self.explore_every // 4) if close else self.explore_every
        return (not better) if asked % every in (0, 1) else better

    def observe(self, rows: int, k: int, tokens: int, seconds: float) -> None:
        """The step just taken (``rows`` rows at ``k``) made ``tokens`` tokens in ``seconds``."""
        if rows <= 1 or seconds <= 0:
            return
        if k > 0:
            kept = self._tokens.setdefault(rows, deque(maxlen=self.window))
            kept.append((self._asked.get(rows, 0), tokens / rows))
        if k == 0 or self._kinds[0]:  # a drafting step after a plain one: tokens, not time
            self._seconds.setdefault((rows, k > 0), deque(maxlen=self.times)).append(seconds)


#: Contexts are bucketed so the policy's answer is kept while rows grow a few tokens.
CONTEXT_BUCKET = 64


class BatchPolicy:
    """k per number of rows and their length, from measured costs (``table``: what
    :func:`measure_batch_costs` returns, or one calibration ``{"verify", "draft"}`` used
    at every length) and acceptance."""

    def __init__(self, table: dict, max_k: int = 8, prior: Sequence[float] = PRIOR_ACCEPTANCE,
                 min_gain: float = MIN_GAIN) -> None:
        self.calibrations = sorted((_Calibration(t) for t in table.get("calibrations", [table])),
                                   key=lambda c: c.context)
        self.max_k = min(max_k, min(max(max(ws) for ws in c.verify.values()) for c in self.calibrations) - 1)
        self.prior = list(prior)
        self.min_gain = min_gain
        self._chosen: dict[tuple, int] = {}  # (rows, context bucket, acceptance source, its version) -> k

    def costs(self, rows: int, context: int | None = None) -> StepCosts:
        """The cost model's step costs for ``rows`` rows of ``context`` tokens on average
        (interpolated between the measured batch sizes and contexts; past the longest
        context, extrapolated linearly; None: the shortest)."""
        cals = self.calibrations
        if context is None or len(cals) == 1 or context <= cals[0].context:
            return cals[0].costs(rows)
        i = next((i for i, c in enumerate(cals) if c.context > context), len(cals) - 1)
        lo, hi = cals[i - 1], cals[i]
        a, b = lo.costs(rows), hi.costs(rows)
        f = (context - lo.context) / (hi.context - lo.context)
        mix = lambda x, y: x + (y - x) * f  # noqa: E731
        return StepCosts(t_ar=mix(a.t_ar, b.t_ar), t_draft=mix(a.t_draft, b.t_draft),
                         verify={w: mix(a.verify[w], b.verify[w]) for w in a.verify if w in b.verify})

    def k(self, rows: int, pooled: GenerationStats | RecentAcceptance | None = None,
          context: int | None = None) -> int:
        """The k to use with ``rows`` rows of ``context`` tokens on average, given the
        acceptance of the batch's recent proposals.

        Asked every step: the answer is kept until the acceptance changes or the rows grow
        into the next ``CONTEXT_BUCKET``, so a batch at k = 0 (no proposals, nothing new to
        learn) pays almost nothing for the policy."""
        bucket = None if context is None else context // CONTEXT_BUCKET
        key = (rows, bucket, id(pooled), getattr(pooled, "version", None))
        if key[3] is not None and key in self._chosen:
            return self._chosen[key]
        k = self._choose(rows, pooled, None if bucket is None else bucket * CONTEXT_BUCKET + CONTEXT_BUCKET // 2)
        if key[3] is not None:
            if len(self._chosen) > 256:
                self._chosen.clear()
            self._chosen[key] = k
        return k

    def _choose(self, rows: int, pooled: GenerationStats | RecentAcceptance | None,
                context: int | None = None) -> int:
        per_position = self.prior
        if pooled is not None and pooled.drafted_tokens >= MIN_DRAFTED:
            per_position = pooled.per_position_acceptance
        min_gain = min(self.min_gain, LONE_ROW_MIN_GAIN) if rows == 1 else self.min_gain
        return choose_k(self.costs(rows, context), per_position=per_position, max_k=self.max_k,
                        min_gain=min_gain)

    @classmethod
    def for_engine(cls, engine, remeasure: bool = False, log=None) -> BatchPolicy:
        """Measure (or read the cached) costs for this engine's target, drafter and batch size
        (the draft model's step, or early exit's: the target's first layers + its head).
        Timings too noisy to trust are taken again; if they stay noisy they are used but not
        cached, and ``log`` (default: a line on stderr) says so."""
        from ..drafters.batched import BatchedChain, BatchedDraftModel
        from ..drafters.hybrid import HybridDrafter

        drafter = engine.drafter.model if isinstance(engine.drafter, HybridDrafter) else engine.drafter
        drafter = drafter if isinstance(drafter, BatchedChain) else None
        # A draft model's costs follow its weights; early exit's its layer and head kind (its name).
        draft = drafter.lm if isinstance(drafter, BatchedDraftModel) else getattr(drafter, "name", None)
        sizes = batch_sizes(engine.max_batch_size)
        entry = policy_cache.entry("batch", CACHE_VERSION, {"target": engine.target, "draft": draft},
                            sizes=sizes, widths=list(WIDTHS), contexts=list(CONTEXTS))
        if entry is not None and not remeasure:
            data = entry.load()
            if data is not None:
                try:
                    return cls(data)
                except (ValueError, KeyError, TypeError, AttributeError):
                    pass  # not what this version writes: measure again
        log = log or _notice
        table, noise = timing.least_noisy(
            lambda: (t := measure_batch_costs(engine.model, engine.cache, drafter, sizes), t.get("spread", 0.0)), log=log)
        if noise.noisy:
            log(f"not caching the batch policy's costs: {noise.describe()} (is the machine busy?); "
                "used for this engine only, measured again next time")
        elif entry is not None:
            try:
                entry.store(table)
            except OSError:
                pass  # not cached: measured again next time
        return cls(table)


def _notice(message: str) -> None:
    print(f"quickdraft: {message}", file=sys.stderr, flush=True)
