"""Whether timings are quiet enough to keep: a measurement taken while the machine was busy
must not be cached for good.

Every cost measurement repeats each of its timings; :func:`relative_spread` is their
interquartile range over their median, and a measurement's spread (:func:`spread_of`) is
the one a quarter of its timings exceed: one hiccup in one timing does not count, a busy
machine does. On a quiet CPU the embedded pair's step timings spread under 5% (the batch
policy's, three samples each: 2-6%); with another process competing for the two cores,
20-130%. A measurement spreading more than :data:`NOISE_LIMIT` is taken again, up to
``attempts`` times (:func:`least_noisy`); if every attempt is noisy, the least noisy one is
used for the run and the caller does not cache it.

The clock is :data:`clock`, looked up at each measurement, so tests can replace it.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar


def device_clock() -> float:
    """``time.perf_counter()`` once the GPU's queued work (if CUDA is in use) has run: a GPU
    pass returns when it is queued, not when it is done. On the CPU, the plain clock."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


#: The clock timings are taken with (tests substitute a fake one).
clock: Callable[[], float] = device_clock

#: Relative spread (IQR / median) above which a timing is too noisy to cache.
NOISE_LIMIT = 0.25
#: Measurements taken at most before giving up on a quiet one.
ATTEMPTS = 3

T = TypeVar("T")


def noise_limit() -> float:
    """:data:`NOISE_LIMIT`, or ``$QUICKDRAFT_NOISE_LIMIT`` when set (e.g. ``inf``: cache
    whatever was measured)."""
    try:
        return float(os.environ.get("QUICKDRAFT_NOISE_LIMIT", NOISE_LIMIT))
    except ValueError:
        return NOISE_LIMIT


def relative_spread(samples: Iterable[float]) -> float:
    """Interquartile range over median of timing samples (0 for fewer than 2)."""
    values = sorted(samples)
    if len(values) < 2:
        return 0.0
    q1, middle, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / middle if middle > 0 else float("inf")


def spread_of(series: Iterable[Iterable[float]]) -> float:
    """The :func:`relative_spread` that a quarter of the timings (series of samples of one
    quantity each) exceed: their 75th percentile (0 without any)."""
    spreads = sorted(relative_spread(s) for s in series)
    return spreads[math.ceil(0.75 * len(spreads)) - 1] if spreads else 0.0


@dataclass
class Noise:
    """How noisy the kept measurement was: its :func:`spread_of`, after how many attempts,
    against which limit."""

    spread: float
    attempts: int
    limit: float

    @property
    def noisy(self) -> bool:
        return self.spread > self.limit

    def describe(self) -> str:
        tries = f"{self.attempts} attempt{'s' if self.attempts != 1 else ''}"
        return f"timings spread {self.spread:.0%} after {tries}, over the {self.limit:.0%} limit"


def least_noisy(measure: Callable[[], tuple[T, float]], attempts: int = ATTEMPTS,
                limit: float | None = None, log: Callable[[str], None] | None = None) -> tuple[T, Noise]:
    """Call ``measure`` (returning a result and its timings' :func:`spread_of`) until a
    result is quiet (spread <= ``limit``) or ``attempts`` calls are made; the quiet result,
    else the least noisy one, with its :class:`Noise`. ``log`` gets a line before each
    repeated attempt."""
    limit = noise_limit() if limit is None else limit
    best: tuple[T, float] | None = None
    attempt = 0
    for attempt in range(1, max(attempts, 1) + 1):
        result, spread = measure()
        if best is None or spread < best[1]:
            best = (result, spread)
        if spread <= limit:
            break
        if attempt < attempts and log is not None:
            log(f"timings spread {spread:.0%} (over {limit:.0%}: is the machine busy?); "
                f"measuring again ({attempt + 1} of {attempts})")
    assert best is not None
    return best[0], Noise(best[1], attempt, limit)
