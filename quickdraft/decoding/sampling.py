"""Logit warping and token choice, shared by every drafter and acceptance rule.

Speculative sampling is only exact when the draft distribution q and the target
distribution p are warped identically, so there is exactly one warping function.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..models import cpu_kernels

#: Temperatures below this are greedy: dividing logits by a smaller one overflows float32
#: to inf (then NaN), and the distribution is an argmax already (vLLM's threshold too).
GREEDY_BELOW = 1e-5


class SamplingError(ValueError):
    """A row's distribution is not a distribution (NaN, inf or no mass): that row fails."""


#: The highest temperature: above ~100 sampling is all but uniform, and a temperature that
#: overflows float32 (1e308 reached the server) turned every distribution into NaNs.
MAX_TEMPERATURE = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. ``temperature`` below :data:`GREEDY_BELOW` (0 included) means
    greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for name, kind, what in (("temperature", numbers.Real, "a number"), ("top_k", numbers.Integral, "an integer"),
                                 ("top_p", numbers.Real, "a number")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kind):
                raise TypeError(f"{name} must be {what}, got {value!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)):
            raise TypeError(f"seed must be an integer or None, got {self.seed!r}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def generator(self) -> torch.Generator:
        """A CPU generator seeded from ``seed`` (random seed when None)."""
        gen = torch.Generator()
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (the order transformers uses); last dim is vocab."""
    logits = logits.float()
    if not params.greedy and params.temperature != 1.0:
        logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already cover top_p (always keeps the first).
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= params.top_p
        drop_sorted[..., 0] = False  # a top_p that rounds to 0 in float32 would drop every token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution for ``logits`` under ``params`` (not for greedy), in
    float32 whatever the model's dtype (``warp_logits`` casts first)."""
    return warp_logits(logits, params).softmax(dim=-1)


def host_probabilities(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """:func:`probabilities` on the sampling generator's device (the CPU), where draws
    are made and a proposal's q meets the target's p: computed where the logits are (a
    GPU), then one copy; nothing moves on the CPU."""
    return probabilities(logits, params).to(generator.device)


def host_probabilities_rows(logits: Sequence[torch.Tensor], params: Sequence[SamplingParams],
                            device: torch.device) -> list[torch.Tensor]:
    """:func:`host_probabilities` for many rows (logits ``[V]`` or ``[n, V]`` each, each row
    with its own params): computed where the logits are, then one copy to ``device`` for
    all of them (on a GPU one synchronisation, not one a row). The same values."""
    probs = [probabilities(x, p) for x, p in zip(logits, params)]
    flat = [p.reshape(-1, p.shape[-1]) for p in probs]
    copied = torch.cat(flat).to(device).split([f.shape[0] for f in flat])
    return [c.view(p.shape) for c, p in zip(copied, probs)]


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from a 1-D probability vector; :class:`SamplingError` when it has
    NaN, inf or no mass (checked here, per row, so one bad row fails alone)."""
    return int(draw(probs, 1, generator)[0])


def draw(probs: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` i.i.d. token ids from the 1-D distribution ``probs`` (non-negative, any positive
    total), by inverse CDF in float64: ``u`` uniform below the total, the first id whose
    cumulative mass exceeds ``u``, so an id of zero probability is never drawn. What
    ``torch.multinomial(probs, n, replacement=True)`` samples, at ~60 us instead of ~1 ms
    over a 49,152-token vocabulary on this CPU (a sampled SmolLM2 step is ~7 ms).
    :class:`SamplingError` when ``probs`` has NaN, inf or no mass (a NaN or inf anywhere
    reaches the running total's last entry)."""
    cdf = probs.double().cumsum(0)
    total = float(cdf[-1])
    if not math.isfinite(total) or not total > 0:
        raise SamplingError("the sampling distribution has NaN, infinite or no probability mass; "
                            "try another temperature or top_p")
    u = torch.rand(n, generator=generator, dtype=torch.float64, device=cdf.device) * total
    ids = torch.searchsorted(cdf, u, right=True)
    if bool((ids == cdf.numel()).any()):  # u rounded up to the total: the last id with mass
        ids.clamp_(max=int(probs.nonzero()[-1]))
    return ids


def argmax_ids(logits: torch.Tensor | Sequence[torch.Tensor]) -> list[int]:
    """The argmax of every row of ``logits`` (``[..., V]``, or several such tensors, their
    rows one after another) as host ints: our kernel on the CPU in float32 (torch's took
    ~100 us for a 13-token verify pass over 8,192 ids), torch's elsewhere, read from the
    device once for all of them; the same ids either way (the first maximum, the first NaN)."""
    parts = [logits] if isinstance(logits, torch.Tensor) else list(logits)
    ids = [cpu_kernels.argmax_rows(part) for part in parts]
    if all(i is not None for i in ids):
        return [token for part in ids for token in part]
    return torch.cat([part.argmax(dim=-1).reshape(-1) for part in parts]).tolist()


def choose(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[int, torch.Tensor | None]:
    """Pick the next token from 1-D ``logits``; also return its distribution when sampling."""
    if params.greedy:
        return argmax_ids(logits)[0], None
    probs = host_probabilities(logits, params, generator)
    return sample(probs, generator), probs


def choose_rows(
    logits: list[torch.Tensor], params: list[SamplingParams], generators: list[torch.Generator]
) -> list[tuple[int, torch.Tensor | None]]:
    """:func:`choose` for many rows (1-D logits of one length each), with the same tokens
    and distributions, but reading the device once for every greedy row's argmax and once
    for every sampled row's distribution: on a GPU two synchronisations, not one a row."""
    out: list[tuple[int, torch.Tensor | None]] = [(0, None)] * len(logits)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        for i, token in zip(greedy, argmax_ids(torch.stack([logits[i] for i in greedy]))):
            out[i] = (token, None)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        probs = host_probabilities_rows([logits[i] for i in sampled], [params[i] for i in sampled],
                                        generators[sampled[0]].device)
        for i, q in zip(sampled, probs):
            out[i] = (sample(q, generators[i]), q)
    return out
