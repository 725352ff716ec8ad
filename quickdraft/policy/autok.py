"""Measure step costs and acceptance briefly, then let the cost model choose k.

:func:`measure_step_costs` times the model calls a speculative step is made of (target
pass over 1 and over n tokens, one draft step) at a realistic context length;
:func:`calibrate` adds a short calibration decode for per-position acceptance and the cost
model's best k. :func:`cached_k` is what ``quickdraft generate`` uses when no ``-k`` is
given: the choice for a (target, draft, machine) is measured once on fixed calibration
prompts and cached as JSON, with the measured costs (:mod:`.cache`: under
``$XDG_CACHE_HOME/quickdraft/autok/``, default ``~/.cache/quickdraft/autok/``), so the
same pair on the same machine always gets the same k until it is re-measured.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..decoding.engine import PLAIN_CHAIN, decode
from ..decoding.sampling import SamplingParams
from ..decoding.stats import GenerationStats
from ..decoding.stopping import StopConditions
from ..drafters import DraftModelDrafter
from ..models.decode_linear import row_dependent_rounding
from ..models.lm import CausalLM, eos_token_ids
from . import cache, timing
from .cost_model import StepCosts, best_k, speedup_curve

DEFAULT_PROBE_K = 8


def _as_ids(prompt_ids) -> torch.Tensor:
    if isinstance(prompt_ids, torch.Tensor):
        return prompt_ids.to(torch.long).view(-1)
    return torch.tensor(list(prompt_ids), dtype=torch.long)


def _context(prompt: torch.Tensor, length: int, vocab: int) -> torch.Tensor:
    """``length`` token ids starting with the prompt (repeated when the prompt is shorter)."""
    if prompt.numel() == 0:
        prompt = torch.zeros(1, dtype=torch.long)
    reps = -(-length // prompt.numel())
    return prompt.repeat(reps)[:length].clamp_(0, vocab - 1)


#: Untimed plain steps before each timed one (see StepCostSampler.sample). After a prefill
#: the first plain steps are slow and speed up over ~16 of them (SmolLM2 after 200 tokens:
#: 6.5 ms, 5.3 ms at the 5th, 4.1 at the 12th, 3.9 from the 16th; after one 9-token pass
#: 4.3 -> 3.9 ms over ~12): with 3, the bench's per-category samplers, which prepare
#: (prefill) every round, read a plain step ~20% dearer than decoding ran it.
PLAIN_WARMUP = 16


class StepCostSampler:
    """Times the model calls a speculative step is made of, in rounds that can be spread
    over a whole benchmark (so drift in machine speed hits them as it hits the methods).

    One round times, at a context of ``context_length`` tokens: ``target.extend`` over n
    tokens for every verify size (logits of all of them, as the engine asks; n = 1 is a
    plain decode step, timed after another one; a plain greedy token as the engine decodes
    it, :func:`plain_token_seconds`, is ``t_ar``), and before each verify pass a burst of
    consecutive draft steps as the drafter runs them inside a speculative step
    (``_draft_burst``: one-token ``extend`` calls, or a greedy chain in one call; the first
    draft call after a target pass is slower: the target evicted the draft's weights from
    the CPU caches, and the target's pass after the burst is slower too). ``costs()`` gives the medians, ``spread()`` how noisy
    they are (:func:`.timing.spread_of`).
    """

    def __init__(self, target: CausalLM, draft: CausalLM | None, context_ids,
                 verify_sizes: Iterable[int] = range(1, 10), context_length: int | None = None,
                 draft_burst: int | None = None) -> None:
        self.target, self.draft = target, draft
        self.sizes = sorted({int(n) for n in verify_sizes} | {1})
        ids = _as_ids(context_ids)
        length = context_length or ids.numel()
        self.length = max(1, min(length, target.context_length - max(self.sizes) - 1))
        ctx = _context(ids, self.length + max(self.sizes), target.vocab_size)
        self.prefix, self.tail = ctx[: self.length], ctx[self.length :]
        self.burst = draft_burst or max(1, max(self.sizes) - 1)
        self.times: dict[int, list[float]] = {n: [] for n in self.sizes}
        self.plain_times: list[float] = []  # a plain greedy token in a chain (plain_token_seconds)
        self.burst_times: dict[int, list[float]] = {j: [] for j in range(1, self.burst + 1)}
        self._ready = False

    def _prepare(self) -> None:
        self.target.reset(self.length + max(*self.sizes, PLAIN_CHAIN) + 1)
        self.target.extend(self.prefix, logits="none")
        if self.draft is not None:
            self.draft.reset(self.length + self.burst + 1)
            self.draft.extend(self.prefix.clamp(max=self.draft.vocab_size - 1), logits="none")
            self.draft_tokens = self.tail[: self.burst].clamp(max=self.draft.vocab_size - 1)
            if self.draft_tokens.numel() < self.burst:
                self.draft_tokens = self.draft_tokens.repeat(self.burst)[: self.burst]
        self._ready = True

    @torch.inference_mode()
    def sample(self, rounds: int = 1, record: bool = True) -> None:
        """Time ``rounds`` rounds (the caches of both models are reset here: run it
        between generations, not inside one)."""
        self._prepare()
        perf = timing.clock
        for n in self.sizes:  # time each width warm, as a decode loop runs it (the first call is slower)
            self.target.extend(self.tail[:n])
            self.target.crop(self.length)
        # Round by round, every width in each (as the class says): the host's speed drifts
        # over seconds, and a width timed in a block of its own could catch a fast or slow
        # spell the others missed, skewing the ratios the cost model chooses k from. Each
        # pass is timed after what precedes it in decoding: a plain step after plain steps,
        # a verify pass after a draft burst. (A one-token pass right after other calls costs
        # more: SmolLM2's 4.9 ms after a 9-token pass, 5.2 ms after draft steps, 3.2 ms from
        # the fourth plain step in a row on; timed after the wider passes, plain decoding
        # had looked ~30% dearer to the cost model than it is, and speculation better.)
        for _ in range(rounds):
            for n in self.sizes:
                if n == 1:
                    for _ in range(PLAIN_WARMUP):
                        self.target.extend(self.tail[:1])
                        self.target.crop(self.length)
                    plain = plain_token_seconds(self.target, self.tail[:1], perf)
                    if record and plain is not None:
                        self.plain_times.append(plain)
                elif self.draft is not None:
                    with row_dependent_rounding():  # the kernels DraftModelDrafter drafts with
                        burst = self._draft_burst(perf)
                    self.draft.crop(self.length)
                    if record and n == self.sizes[-1]:
                        for j, elapsed in enumerate(burst, 1):
                            self.burst_times[j].append(elapsed)
                started = perf()
                self.target.extend(self.tail[:n])
                elapsed = perf() - started
                self.target.crop(self.length)
                if record:
                    self.times[n].append(elapsed)

    def _draft_burst(self, perf) -> list[float]:
        """Seconds from the start of a burst to the end of each of its draft steps, drafted
        as DraftModelDrafter drafts a greedy chain: its catch-up and the steps in one
        ``greedy_chain`` call where the draft has one (spread evenly over the steps: the
        call returns once), else one ``extend`` each."""
        chain = getattr(self.draft, "greedy_chain", None)
        started = perf()
        if chain is not None and chain(None, self.burst - 1, self.draft.vocab_size,
                                       feed=self.draft_tokens[:1]) is not None:
            total = perf() - started
            return [total * j / self.burst for j in range(1, self.burst + 1)]
        self.draft.extend(self.draft_tokens[:1], logits="last")
        times = [perf() - started]
        for j in range(1, self.burst):
            self.draft.extend(self.draft_tokens[j : j + 1], logits="last")
            times.append(perf() - started)
        return times

    def spread(self) -> float:
        """How noisy the recorded timings are (:func:`.timing.spread_of`)."""
        return timing.spread_of([*self.times.values(), *self.burst_times.values(), self.plain_times])

    def costs(self) -> StepCosts:
        if not self.times[1]:
            self.sample(3)
        verify = {n: statistics.median(v) for n, v in self.times.items() if v}
        burst = {j: statistics.median(v) for j, v in self.burst_times.items() if v}
        return StepCosts(
            t_ar=statistics.median(self.plain_times) if self.plain_times else verify[1],
            t_draft=(burst[self.burst] / self.burst) if burst else 0.0,
            verify=verify,
            draft_burst=burst,
        )


def plain_token_seconds(target: CausalLM, token: torch.Tensor, clock: Callable[[], float]) -> float | None:
    """Seconds a token of plain greedy decoding costs as the engine decodes it where the
    target runs greedy chains in one call (``engine.PLAIN_CHAIN`` tokens a call, after
    ``token``, fed at the end of its cache; the cache is cropped back after): the cost
    model's ``t_ar``, which a one-token ``extend`` overstates by the Python between
    steps. None where the target has no such call (plain decoding steps with ``extend``)."""
    chain = getattr(target, "greedy_chain", None)
    if chain is None:
        return None
    length = target.length
    started = clock()
    tokens = chain(None, PLAIN_CHAIN - 1, target.vocab_size, feed=token)
    elapsed = clock() - started
    target.crop(length)
    return None if tokens is None else elapsed / PLAIN_CHAIN


def measure_step_costs(
    target: CausalLM,
    draft: CausalLM | None,
    context_ids,
    verify_sizes: Iterable[int] = (1, 2, 3, 4, 5, 6, 7, 8, 9),
    repeats: int = 9,
    context_length: int | None = None,
) -> StepCosts:
    """Median seconds of the target over 1 and over n tokens and of draft steps (see
    :class:`StepCostSampler`), after one untimed round; measured once, however noisy (see
    :func:`measure_quiet_step_costs`)."""
    return measure_quiet_step_costs(target, draft, context_ids, verify_sizes, repeats, context_length,
                                    attempts=1)[0]


def measure_quiet_step_costs(
    target: CausalLM,
    draft: CausalLM | None,
    context_ids,
    verify_sizes: Iterable[int] = (1, 2, 3, 4, 5, 6, 7, 8, 9),
    repeats: int = 9,
    context_length: int | None = None,
    attempts: int = timing.ATTEMPTS,
    log: Callable[[str], None] | None = None,
) -> tuple[StepCosts, timing.Noise]:
    """:func:`measure_step_costs`, measured again (up to ``attempts`` times in all) while
    the timings are too noisy to trust; the costs of the quiet (else the least noisy)
    attempt and how noisy it was."""

    def once() -> tuple[StepCosts, float]:
        sampler = StepCostSampler(target, draft, context_ids, verify_sizes, context_length)
        sampler.sample(1, record=False)
        sampler.sample(repeats)
        return sampler.costs(), sampler.spread()

    return timing.least_noisy(once, attempts, log=log)


@dataclass
class AutoKResult:
    k: int
    costs: StepCosts
    per_position: list[float]
    predicted: dict[int, float] = field(default_factory=dict)
    calibration_stats: GenerationStats | None = None
    noise: timing.Noise | None = None  # how noisy the step-cost timings were

    @property
    def predicted_speedup(self) -> float:
        return self.predicted.get(self.k, 1.0)


def calibrate(
    target: CausalLM,
    draft_lm: CausalLM,
    tokenizer=None,
    prompt_ids: Sequence[int] | torch.Tensor = (),
    probe_k: int = DEFAULT_PROBE_K,
    max_k: int = DEFAULT_PROBE_K,
    calibration_tokens: int = 48,
    params: SamplingParams | None = None,
    repeats: int = 7,
    log: Callable[[str], None] | None = None,
) -> AutoKResult:
    """A short speculative decode at ``probe_k`` on the prompt (per-position acceptance)
    and step-cost timings at the resulting context length; the cost model then predicts the
    speedup of every k in 1..max_k (acceptance past ``probe_k`` is extrapolated).

    ``prompt_ids`` is one prompt (ids) or a list of prompts; acceptance is pooled over them.
    Timings too noisy to trust are taken again (:func:`measure_quiet_step_costs`; ``log``
    gets a line each time); ``noise`` says how noisy the kept ones were.
    """
    many = isinstance(prompt_ids, (list, tuple)) and bool(prompt_ids) and not isinstance(prompt_ids[0], int)
    prompts = [_as_ids(p) for p in prompt_ids] if many else [_as_ids(prompt_ids)]
    params = params or SamplingParams()
    eos = eos_token_ids(target, tokenizer)
    stats = GenerationStats()
    drafter = DraftModelDrafter(draft_lm, target.vocab_size)
    context = None
    for ids in prompts:
        if ids.numel() == 0:
            ids = torch.tensor([target.eos_token_ids[0] if target.eos_token_ids else 0])
        budget = max(2, min(calibration_tokens, target.context_length - ids.numel() - probe_k - 2))
        one = GenerationStats()
        generated: list[int] = []
        for step in decode(
            target, ids, StopConditions(budget, eos), drafter=drafter, params=params,
            num_speculative_tokens=probe_k, stats=one,
        ):
            generated.extend(step.tokens)
        stats.merge(one)
        if context is None:
            context = torch.cat([ids, torch.tensor(generated, dtype=torch.long)]) if generated else ids
    per_position = stats.per_position_acceptance or [0.0]
    sizes = range(1, max_k + 2)
    costs, noise = measure_quiet_step_costs(target, draft_lm, context, sizes, repeats=repeats, log=log)
    predicted = speedup_curve(costs, per_position=per_position, max_k=max_k)
    k = best_k(costs, per_position=per_position, max_k=max_k)
    return AutoKResult(k, costs, list(per_position), predicted, stats, noise)


def auto_k(
    target: CausalLM,
    draft_lm: CausalLM,
    tokenizer=None,
    prompt_ids: Sequence[int] | torch.Tensor = (),
    max_k: int = DEFAULT_PROBE_K,
    calibration_tokens: int = 48,
    params: SamplingParams | None = None,
) -> int:
    """The number of draft tokens per step the cost model predicts to be fastest for this
    target, draft and prompt (1..max_k), from a brief calibration (well under a second
    for the embedded pair)."""
    return calibrate(
        target, draft_lm, tokenizer, prompt_ids, probe_k=max_k, max_k=max_k,
        calibration_tokens=calibration_tokens, params=params,
    ).k


# --- the cached choice -------------------------------------------------------------------

#: Fixed calibration prompts (code and prose), so the choice does not depend on the prompt
#: of the run that happened to measure it.
CALIBRATION_PROMPTS = (
    'def median(values):\n    """Return the median of a non-empty list of numbers."""\n',
    "import os\nimport sys\n\n\ndef main(argv=None):\n    parser = argparse.ArgumentParser(",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "The quick brown fox jumps over the lazy dog. Speculative decoding lets a small model",
)
CACHE_VERSION = 5  # 2: entries named and keyed by policy.cache; 3: plain steps timed after plain steps;
#                   4: after 16 of them; 5: t_ar a plain greedy chain's token (plain_token_seconds)
#: Use the draft only when its best k is predicted to be faster than plain decoding.
MIN_GAIN = 1.0


@dataclass
class KChoice:
    """The cost model's k for a pair on this machine and where it came from; k = 0 when even
    the best k is predicted to be no faster than plain decoding (decode without the draft)."""

    k: int
    measured: bool  # True: measured by this call; False: read from the cache
    path: Path | None  # the cache file (None when it could not be written)
    measured_at: str
    predicted: dict[int, float]
    costs: StepCosts
    per_position: list[float]
    noise: timing.Noise | None = None  # a measurement's (None when read from the cache)

    @property
    def predicted_speedup(self) -> float:
        return self.predicted.get(self.k, 1.0)

    @property
    def best_k(self) -> int:
        """The k with the highest predicted speedup (the smallest on ties)."""
        return max(self.predicted, key=lambda k: (round(self.predicted[k], 12), -k)) if self.predicted else 1

    @property
    def source(self) -> str:
        """Where the choice came from, for a log line."""
        return measurement_source(self.measured, self.measured_at, self.path)

    def summary(self) -> str:
        """One line: the k, its predicted speedup and where it came from (or that the draft
        is not used, and how to use it anyway)."""
        if not self.k:
            best = self.best_k
            return (f"decoding without the draft: the cost model predicts it slower than plain decoding "
                    f"(best k={best}: {self.predicted.get(best, 0.0):.2f}x; {self.source}); -k N uses it anyway")
        return f"k={self.k} (cost model: predicted {self.predicted_speedup:.2f}x over plain decoding; {self.source})"

    def to_json(self) -> dict:
        return {
            "k": self.k,
            "measured_at": self.measured_at,
            "predicted_speedup": {str(k): v for k, v in sorted(self.predicted.items())},
            "per_position_acceptance": self.per_position,
            "step_costs": self.costs.to_dict(),
        }


def measurement_source(measured: bool, measured_at: str | None, path: Path | None) -> str:
    """``measured now``, ``measured now, not cached`` or ``cached measurement from
    2026-11-25, re-measure with --remeasure``."""
    if not measured:
        when = f" from {measured_at[:10]}" if measured_at else ""
        return f"cached measurement{when}, re-measure with --remeasure"
    return "measured now" if path is not None else "measured now, not cached"


def cached_k(
    target: CausalLM,
    draft_lm: CausalLM,
    tokenizer,
    remeasure: bool = False,
    log: Callable[[str], None] | None = None,
    max_k: int = DEFAULT_PROBE_K,
    calibration_tokens: int = 64,
) -> KChoice:
    """The cost model's best k for this target, draft and machine, or 0 (plain decoding) when
    even the best is predicted to be no faster than plain decoding: read from the cache, or
    (missing, unreadable, or ``remeasure``) measured greedily on :data:`CALIBRATION_PROMPTS`
    and written there. ``log`` gets one line before a measurement, and one for each
    attempt the timings were too noisy to trust; a choice measured noisy every time is used
    but not cached (``path`` None), and ``log`` says so."""
    log = log or (lambda msg: None)
    prompts = [tokenizer(p, verbose=False)["input_ids"] for p in CALIBRATION_PROMPTS]
    # The tokens measured on (the tokenizer's), not the tokenizer's files: what acceptance depends on.
    entry = cache.entry("k", CACHE_VERSION, {"target": target, "draft": draft_lm}, max_k=max_k,
                        calibration=cache.digest(prompts))
    if entry is not None and not remeasure:
        cached = _read_choice(entry)
        if cached is not None:
            return cached
    where = f"cached in {entry.path}" if entry is not None else "not cached: the models have no directory"
    log(f"measuring the best k for this model pair on this machine, once ({where}; --remeasure redoes it)")
    result = calibrate(target, draft_lm, tokenizer, prompts, probe_k=max_k, max_k=max_k,
                       calibration_tokens=calibration_tokens, log=log)
    k = result.k if result.predicted_speedup > MIN_GAIN else 0
    choice = KChoice(k, True, None, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     result.predicted, result.costs, result.per_position, result.noise)
    if result.noise is not None and result.noise.noisy:
        log(f"not caching k={choice.k}: {result.noise.describe()} (is the machine busy?); "
            "used for this run only, measured again next time")
    elif entry is not None:
        try:
            entry.store(choice.to_json())
            choice.path = entry.path
        except OSError as exc:
            log(f"could not write the auto-k cache ({exc.strerror or exc}); k is not cached")
    return choice


def _read_choice(entry: cache.Entry) -> KChoice | None:
    data = entry.load()
    if data is None:
        return None  # missing or unreadable: measure again
    try:
        return KChoice(
            k=int(data["k"]), measured=False, path=entry.path, measured_at=str(data["measured_at"]),
            predicted={int(k): float(v) for k, v in data["predicted_speedup"].items()},
            costs=StepCosts.from_dict(data["step_costs"]),
            per_position=[float(a) for a in data["per_position_acceptance"]],
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return None  # not what this version writes: measure again
