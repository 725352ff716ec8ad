"""Rows stepped one after another through the one decode loop (:func:`quickdraft.decoding.engine.decode`).

The server's engine for what the batched engine does not do (token trees, multi-draft, the
transformers backend), with the batched engine's interface: ``add`` a row, ``step`` every
active row once, ``cancel`` a row. Each row runs its own ``decode`` iterator with its own
model handles (their own KV caches and lengths) over the weights every row shares, so rows
never see each other's cache; a row's cache is freed when it finishes or is cancelled.
Output is that of a lone generation, token for token: each row is exactly one.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..decoding.batch_engine import BatchFullError, RowUpdate
from ..decoding.engine import Step, decode
from ..decoding.sampling import SamplingError, SamplingParams
from ..decoding.stats import GenerationStats
from ..decoding.step import EMPTY_PROMPT, ContextOverflowError
from ..decoding.stopping import StopConditions
from ..drafters import DraftOptions, make_drafter
from ..generator import DEFAULT_NUM_SPECULATIVE_TOKENS
from ..models.lm import CausalLM, HFCausalLM, NativeLM


def fork(lm: CausalLM) -> CausalLM:
    """A new handle over ``lm``'s weights: its own cache and length, nothing copied."""
    if isinstance(lm, NativeLM):
        return NativeLM(lm.model, lm.model_dir, decode_linears=lm.decode_linears)
    if isinstance(lm, HFCausalLM):
        return HFCausalLM(lm.model, lm.model_dir)
    raise TypeError(f"cannot share the weights of a {type(lm).__name__} between rows")


def release(lm: CausalLM | None) -> None:
    """Free a handle's KV cache (the next ``reset`` allocates a new one)."""
    if isinstance(lm, NativeLM):
        lm.cache = None
    elif isinstance(lm, HFCausalLM):
        lm.past = None
    if lm is not None:
        lm.length = 0


def cache_bytes(lm: CausalLM | None) -> int:
    """Bytes held by a handle's KV cache (0 when it holds none)."""
    if isinstance(lm, NativeLM) and lm.cache is not None:
        return lm.cache.k.nbytes + lm.cache.v.nbytes
    past = getattr(lm, "past", None)
    if isinstance(lm, HFCausalLM) and past is not None:
        return sum(t.nbytes for layer in getattr(past, "layers", []) for t in (layer.keys, layer.values)
                   if isinstance(t, torch.Tensor))
    return 0


@dataclass
class _Row:
    steps: Iterator[Step]
    stats: GenerationStats
    target: CausalLM
    draft: CausalLM | None


class SoloEngine:
    """Up to ``max_batch_size`` generations at once, each a :func:`decode` of its own.

    ``method``, ``draft``, ``num_speculative_tokens`` (None: 4), ``options`` and
    ``acceptance`` are those of :class:`~quickdraft.generator.SpeculativeGenerator`.
    ``max_len`` (None: the model's context) bounds prompt + new tokens of a row.
    """

    name = "solo"

    def __init__(
        self,
        target: CausalLM,
        *,
        method: str = "draft",
        draft: CausalLM | None = None,
        max_batch_size: int = 8,
        max_len: int | None = None,
        num_speculative_tokens: int | None = None,
        options: DraftOptions = DraftOptions(),
        acceptance: str = "mss",
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        make_drafter(method, draft, target.vocab_size, options, target=target)  # bad settings fail here, not per row
        self.target, self.draft, self.method, self.options = target, draft, method, options
        self.max_batch_size = max_batch_size
        self.max_len = min(max_len or target.context_length, target.context_length)
        self.num_speculative_tokens = (DEFAULT_NUM_SPECULATIVE_TOKENS if num_speculative_tokens is None
                                       else num_speculative_tokens)
        self.acceptance = acceptance
        self._rows: dict[int, _Row] = {}
        self._next_row = 0

    @property
    def active(self) -> int:
        return len(self._rows)

    @property
    def free_slots(self) -> int:
        return self.max_batch_size - len(self._rows)

    @property
    def kv_cache_bytes(self) -> int:
        """KV cache memory held by the active rows (0 when idle)."""
        return sum(cache_bytes(r.target) + cache_bytes(r.draft) for r in self._rows.values())

    def add(self, prompt: torch.Tensor, params: SamplingParams, stop: StopConditions) -> int:
        """Start a row generating after ``prompt`` (``[T]`` ids); returns its id. Nothing
        runs until the next :meth:`step`."""
        if not self.free_slots:
            raise BatchFullError(f"all {self.max_batch_size} rows are busy")
        prompt = prompt.to(torch.long).view(-1)
        if prompt.numel() == 0:
            raise ValueError(EMPTY_PROMPT)
        if prompt.numel() >= self.max_len:
            raise ContextOverflowError(
                f"the prompt has {prompt.numel()} tokens but a row holds at most {self.max_len}; shorten it"
            )
        target = fork(self.target)
        draft = fork(self.draft) if self.draft is not None else None
        drafter = make_drafter(self.method, draft, target.vocab_size, self.options, target=target)
        stats = GenerationStats()
        steps = decode(target, prompt, stop, drafter, params, self.num_speculative_tokens,
                       self.acceptance, stats)
        row = self._next_row
        self._next_row += 1
        self._rows[row] = _Row(steps, stats, target, draft)
        return row

    def cancel(self, row: int) -> None:
        """Stop a row now and free its cache (unknown or finished rows are ignored)."""
        state = self._rows.pop(row, None)
        if state is not None:
            state.steps.close()
            release(state.target)
            release(state.draft)

    def step(self) -> dict[int, RowUpdate]:
        """One target pass for every active row; finished rows are removed afterwards. A
        row that raises (its distribution is NaN, its settings fail late, a bug) ends with
        ``finish="error"`` and its caches freed; the other rows go on."""
        updates: dict[int, RowUpdate] = {}
        for row, state in list(self._rows.items()):
            try:
                updates[row] = self._advance(state)
            except Exception as exc:  # rows share no state: this one fails alone
                updates[row] = RowUpdate([], 0, "error", state.stats, error=_row_error(exc),
                                         error_code="sampling_error" if isinstance(exc, SamplingError) else "server_error")
            if updates[row].finish:
                self.cancel(row)
        return updates

    @staticmethod
    def _advance(state: _Row) -> RowUpdate:
        step = next(state.steps, None)
        if step is None:  # ended without a token (EOS first)
            return RowUpdate([], 0, state.stats.finish_reason or "stop", state.stats)
        if step.finish:
            for _ in state.steps:  # no pass left: completes the stats (decode time)
                pass
        return RowUpdate(step.tokens, step.drafted, step.finish, state.stats)


def _row_error(exc: Exception) -> str:
    """What the row's request is told: a sampling error's own message (the request's
    numbers); anything else is a bug, logged with its traceback and named by type only."""
    if isinstance(exc, SamplingError):
        return str(exc)
    traceback.print_exception(exc, file=sys.stderr)
    return f"the engine failed on this request ({type(exc).__name__})"
