"""The rows of a benchmark: our decode loop with a drafter (:class:`EngineMethod`) and
transformers' ``generate()`` (:class:`HFMethod`). Which rows a method name makes is up to
:mod:`.registry`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import torch

from ..decoding.engine import decode
from ..decoding.sampling import SamplingParams
from ..decoding.stats import GenerationStats
from ..decoding.stopping import StopConditions
from ..decoding.verify import AcceptanceRule
from ..drafters import NoDrafter
from ..models.transformer import attention_kernels
from .context import BenchContext
from .results import RunOutput

HIDDEN_SETTINGS = ("schedule", "confidence_threshold")  # constant; in the JSON, not in labels


class Method(Protocol):
    """One row of the benchmark.

    ``name`` is the method's name, ``settings`` what distinguishes its rows (shown in the
    table), ``k`` its draft tokens per step (None for plain decoding), ``kind`` who
    implements it ("quickdraft" or "transformers") and ``speculative`` whether it drafts
    (a speculative row slower than plain decoding gets a warning).
    """

    name: str
    settings: dict
    k: int | None
    kind: str
    speculative: bool

    @property
    def label(self) -> str: ...

    def run(self, ctx: BenchContext, prompt: torch.Tensor, max_new_tokens: int,
            params: SamplingParams, prompt_key: str = "") -> RunOutput: ...


def label(name: str, settings: dict) -> str:
    """A row's unique name: the method and its settings, e.g. ``draft k=4``."""
    shown = {k: v for k, v in settings.items() if k not in HIDDEN_SETTINGS}
    return name + (" " + ",".join(f"{k}={v}" for k, v in shown.items()) if shown else "")


class EngineMethod:
    """Our decode loop with a drafter (or none) and an optional acceptance rule.

    ``drafter_factory(ctx)`` makes the drafter once, on the first run (None: plain decoding);
    ``acceptance(params)`` the acceptance rule of a run (None: the engine's lossless default).
    """

    kind = "quickdraft"

    def __init__(self, name: str, drafter_factory: Callable[[BenchContext], object] | None,
                 k: int | None = None, settings: dict | None = None,
                 acceptance: Callable[[SamplingParams], AcceptanceRule] | None = None) -> None:
        self.name = name
        self.k = k
        self.settings = dict(settings or ({"k": k} if k else {}))
        self.speculative = drafter_factory is not None
        self._factory = drafter_factory
        self._drafter = None
        self._acceptance = acceptance

    @property
    def label(self) -> str:
        return label(self.name, self.settings)

    def run(self, ctx, prompt, max_new_tokens, params, prompt_key=""):
        if self._drafter is None:
            self._drafter = self._factory(ctx) if self._factory else NoDrafter()
        stats = GenerationStats()
        tokens: list[int] = []
        acceptance = self._acceptance(params) if self._acceptance else None
        for step in decode(
            ctx.target, prompt, StopConditions(max_new_tokens, ctx.eos_token_ids),
            drafter=self._drafter, params=params, num_speculative_tokens=self.k or 1,
            acceptance=acceptance, stats=stats,
        ):
            tokens.extend(step.tokens)
        return RunOutput(tokens, stats.decode_seconds, stats.prefill_seconds + stats.decode_seconds, stats)


class HFMethod:
    """transformers ``generate()``: plain, with ``assistant_model`` (same draft, same k,
    constant schedule, confidence threshold 0), or with ``lookup`` its prompt-lookup
    decoding (``prompt_lookup_num_tokens=k``, n-grams up to ``lookup`` tokens: the n-gram
    baseline, no draft model)."""

    kind = "transformers"

    def __init__(self, name: str, k: int | None = None, lookup: int | None = None) -> None:
        self.name = name
        self.k = k
        self.lookup = lookup
        self.speculative = k is not None
        if lookup:
            self.settings = {"k": k, "ngram_max": lookup}
        else:
            self.settings = {"k": k, "schedule": "constant", "confidence_threshold": 0} if k else {}

    @property
    def uses_draft(self) -> bool:
        return bool(self.k) and not self.lookup

    @property
    def label(self) -> str:
        return label(self.name, self.settings)

    def _generate(self, ctx, prompt, max_new_tokens, params):
        from transformers import GenerationConfig

        target = ctx.hf_model("target")
        kwargs = {}
        if self.lookup:
            kwargs["prompt_lookup_num_tokens"] = self.k
            kwargs["max_matching_ngram_size"] = self.lookup
        elif self.k:
            assistant = ctx.hf_model("draft")
            assistant.generation_config.num_assistant_tokens = self.k
            assistant.generation_config.num_assistant_tokens_schedule = "constant"
            assistant.generation_config.assistant_confidence_threshold = 0.0
            kwargs["assistant_model"] = assistant
        eos = ctx.eos_token_ids
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=not params.greedy,
            temperature=params.temperature if not params.greedy else None,
            top_k=params.top_k if not params.greedy else None,
            top_p=params.top_p if not params.greedy else None,
            eos_token_id=eos or None,
            pad_token_id=eos[0] if eos else 0,
        )
        if not params.greedy:
            torch.manual_seed(params.seed if params.seed is not None else 0)
        ids = prompt.view(1, -1).to(target.device)
        # the attention kernels our runtime uses on this device: a like-for-like baseline
        with torch.inference_mode(), attention_kernels(target.device):
            out = target.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, **kwargs)
        return out[0, ids.shape[1]:].tolist()

    def _prefill_sample(self, ctx, prompt, params) -> float:
        """Seconds of ``generate(max_new_tokens=1)`` (plus, for hf-assisted, one assistant
        forward pass over the prompt, which transformers runs inside its first step)."""
        started = time.perf_counter()
        self._generate(ctx, prompt, 1, params)
        if self.uses_draft:
            with torch.inference_mode():
                draft = ctx.hf_model("draft")
                draft(prompt.view(1, -1).to(draft.device), use_cache=True)
                if draft.device.type == "cuda":
                    torch.cuda.synchronize(draft.device)  # the pass has run, not only been queued
        return time.perf_counter() - started

    def run(self, ctx, prompt, max_new_tokens, params, prompt_key=""):
        # One prefill sample per run (two on the first), kept per prompt: the decode time is
        # computed from their median when the results are summarised.
        key = (self.name, prompt_key or tuple(prompt.tolist()))
        samples = ctx.prefill_timings.setdefault(key, [])
        for _ in range(1 if samples else 2):
            samples.append(self._prefill_sample(ctx, prompt, params))
        ctx.hf_model("target")
        if self.uses_draft:
            ctx.hf_model("draft")
        target, draft = ctx.counters["target"], ctx.counters.get("draft") if self.uses_draft else None
        t0, d0 = target.calls, draft.calls if draft is not None else 0
        started = time.perf_counter()
        tokens = self._generate(ctx, prompt, max_new_tokens, params)
        total = time.perf_counter() - started
        t_calls = target.calls - t0
        d_calls = (draft.calls - d0) if draft is not None else None
        # Our engine leaves EOS out of the output; so do we here.
        eos = set(ctx.eos_token_ids)
        for i, t in enumerate(tokens):
            if t in eos:
                tokens = tokens[:i]
                break
        return RunOutput(tokens, 0.0, total, None, target_passes=t_calls, draft_passes=d_calls,
                         prefill_samples=samples)
