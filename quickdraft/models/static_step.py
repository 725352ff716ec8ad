"""The target's chain pass at one fixed width, with every shape static: what CUDA graphs
(through ``torch.compile(mode="reduce-overhead")``) can capture.

On a GPU a small-batch decode step is dominated by kernel launches unless it is
captured, and a capture replays fixed shapes at fixed addresses. ``Transformer.forward``
already runs without host reads when its positions and slots are device tensors and its
mask covers the whole cache; this module feeds it that way: tokens padded to ``width``
in a static buffer, positions ``start + 0 .. width - 1`` computed on the device, attention
over the whole (preallocated) cache with a mask, logits of every row. Padding rows write
keys and values past the sequence, where nothing attends and the next pass overwrites
them (as a rejected draft's do), so the cache needs ``width`` slots of slack.

Opt-in (``NativeLM.use_static_step``); without compilation it runs eagerly, which is how
the CPU tests check it. Where compilation fails, :class:`CompiledStep` falls back to eager.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from .kv_cache import KVCache
from .transformer import Transformer


class CompiledStep:
    """``torch.compile(fn, mode=...)``, falling back to ``fn`` itself (with a warning, and
    ``eager`` set) where this torch or platform cannot compile it, or where the compiled
    step fails on a call."""

    def __init__(self, fn: Callable, mode: str = "reduce-overhead") -> None:
        self.fn, self.eager = fn, False
        try:
            self.compiled = torch.compile(fn, mode=mode, dynamic=False)
        except Exception as exc:  # no compiler toolchain, an unsupported platform, ...
            self._fall_back(exc)

    def _fall_back(self, exc: Exception) -> None:
        text = str(exc).splitlines()[0][:160] if str(exc) else ""
        warnings.warn(f"the compiled decoding step is unavailable ({type(exc).__name__}: {text}); "
                      "steps run eagerly", stacklevel=3)
        self.eager = True

    def __call__(self, *args):
        if not self.eager:
            try:
                return self.compiled(*args)
            except Exception as exc:  # e.g. inductor without a compiler, at the first call
                self._fall_back(exc)
        return self.fn(*args)


class StaticStep:
    """``model``'s pass over up to ``width`` new tokens of one sequence in ``cache`` (row 0),
    at fixed shapes: ``step(tokens, start)`` returns the logits ``[T, V]`` of the ``T`` tokens
    fed at positions (and slots) ``start ..``."""

    def __init__(self, model: Transformer, cache: KVCache, width: int, compile: bool | str = False) -> None:
        device = cache.k.device
        self.model, self.cache, self.width = model, cache, width
        self.tokens = torch.zeros(1, width, dtype=torch.long, device=device)
        self.start = torch.zeros(1, dtype=torch.long, device=device)
        self.offsets = torch.arange(width, device=device)
        self.cache_slots = torch.arange(cache.max_len, device=device)
        # Every position, in the RoPE table before any capture: the traced step reads it
        # without checking its length on the host.
        if model._inv_freq is not None:
            model._rope(0, max(cache.max_len, model.config.max_position_embeddings))
        self.compiled = compile
        if compile:
            # Buffers at fixed addresses, mutated in place: what a CUDA graph may capture.
            for t in (cache.k, cache.v, self.tokens, self.start):
                torch._dynamo.mark_static_address(t)
        # (a mode by name, e.g. "max-autotune": tuned matrix kernels as well as CUDA graphs)
        self.fn = CompiledStep(self._step, compile if isinstance(compile, str) else "reduce-overhead") \
            if compile else self._step

    def _step(self, tokens: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        positions = (start + self.offsets)[None]  # [1, W], on the device
        mask = self.cache_slots[None, :] <= positions[0, :, None]  # [W, S]: causal over the whole cache
        return self.model(tokens, positions, self.cache, slots=positions, mask=mask[None], logits="all").logits

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        n = tokens.shape[-1]
        if n > self.width or start + self.width > self.cache.max_len:
            raise ValueError(f"a static step feeds at most {self.width} tokens before slot "
                             f"{self.cache.max_len - self.width}, got {n} at {start}")
        self.tokens[0, :n].copy_(tokens.view(-1), non_blocking=True)
        self.start.fill_(start)  # a host scalar written on the device: no synchronisation
        logits = self.fn(self.tokens, self.start)[0, :n]
        # A graph's output buffer is rewritten by its next replay: hand out a copy.
        return logits.clone() if self.compiled else logits
