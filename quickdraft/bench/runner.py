"""The benchmark: methods as small objects, and the one measurement loop.

Rules (docs/speculative-decoding.md, section 6): same target, same prompts, same machine,
same process; a warm-up run per method first; batch 1; methods alternate within every
(repeat, prompt) in a rotating order so drift in machine speed hits all of them alike;
medians over prompts and repeats.

Definitions used in every row:

- ``tokens_per_second`` (decode): new tokens / decode seconds, where decode excludes the
  prefill (the target's first pass, over the prompt; speculative rows, ours and
  transformers' alike, also verify a draft proposed from the prompt in it). Our rows take
  it from :attr:`GenerationStats.tokens_per_second`. transformers rows time the whole
  ``generate()`` call and subtract that prompt's prefill, measured separately as a
  ``generate(max_new_tokens=1)`` call (plus, for ``hf-assisted``, one forward pass of the
  assistant over the prompt, which transformers does inside its first step).
- ``e2e_tokens_per_second``: new tokens / total seconds including prefill (all rows).
- ``speedup``: per prompt, the median tokens/s of the row over repeats divided by that of
  ``ar``; the row's speedup is the median over prompts (``e2e_speedup`` likewise).
- ``lossless`` (greedy): the row's tokens equal ``ar``'s on every prompt and repeat;
  None when sampling (exactness is then shown by the statistical tests).

New methods register a factory with :func:`register_method`; a factory returns one or
more :class:`Method` objects (rows).
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ..drafters import DraftModelDrafter, NoDrafter
from ..engine import decode
from ..models.lm import CausalLM, load_model
from ..sampling import SamplingParams
from ..stats import GenerationStats
from ..stopping import StopConditions
from ..verify import AcceptanceRule
from .autok import StepCostSampler, calibrate, pool_stats
from .cost_model import StepCosts, predicted_speedup, where_time_goes
from .prompts import BenchPrompt


class BenchError(ValueError):
    """Bad benchmark input (unknown method, missing draft, ...); the message is one line."""


@dataclass
class BenchConfig:
    model: str | None = None
    draft: str | None = None
    methods: Sequence[str] = ("ar", "draft", "hf-ar", "hf-assisted")
    max_new_tokens: int = 128
    repeats: int = 3
    temperature: float = 0.0
    seed: int = 0
    k: int | None = None  # None: the cost model's choice from a calibration run
    sweep: Sequence[int] = ()  # extra draft rows at these k
    quick: bool = False
    threads: int | None = 2
    warmup_tokens: int = 32
    backend: str = "native"

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["methods"] = list(self.methods)
        d["sweep"] = list(self.sweep)
        return d


@dataclass
class RunOutput:
    """One timed generation. ``prefill_samples`` (transformers rows): timings of that
    prompt's prefill, collected over the whole run; decode time = total - their median."""

    tokens: list[int]
    decode_time: float
    total_seconds: float
    stats: GenerationStats | None = None
    target_passes: int | None = None  # for rows without stats (transformers)
    draft_passes: int | None = None
    prefill_samples: list[float] | None = None

    @property
    def decode_seconds(self) -> float:
        if self.prefill_samples:
            return max(self.total_seconds - statistics.median(self.prefill_samples), 1e-9)
        return self.decode_time

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tokens_per_second(self) -> float:
        if self.stats is not None:
            return self.stats.tokens_per_second
        return self.new_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def e2e_tokens_per_second(self) -> float:
        return self.new_tokens / self.total_seconds if self.total_seconds > 0 else 0.0


class BenchContext:
    """What methods share: the loaded models (native handles; transformers models lazily),
    the tokenizer, EOS ids and per-prompt caches."""

    def __init__(self, target: CausalLM, tokenizer, draft: CausalLM | None = None,
                 target_dir: Path | None = None, draft_dir: Path | None = None) -> None:
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.target_dir = Path(target_dir or target.model_dir)
        self.draft_dir = Path(draft_dir or draft.model_dir) if (draft_dir or draft is not None) else None
        eos = list(target.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            if tokenizer.eos_token_id not in eos:
                eos.append(tokenizer.eos_token_id)
        self.eos_token_ids = eos
        self._hf: dict[str, object] = {}
        self.cache: dict = {}

    def hf_model(self, which: str):
        """The transformers model ("target" or "draft") loaded from the same directory, fp32."""
        if which not in self._hf:
            from ..models.lm import load_hf_model

            path = self.target_dir if which == "target" else self.draft_dir
            if path is None:
                raise BenchError("hf-assisted needs a draft model; pass --draft")
            model = load_hf_model(path, torch.float32).eval()
            counter = {"calls": 0}

            def hook(module, args, output, counter=counter):
                counter["calls"] += 1

            model.register_forward_hook(hook)
            model._qd_counter = counter
            self._hf[which] = model
        return self._hf[which]


class Method(Protocol):
    """One row of the benchmark."""

    name: str
    settings: dict
    k: int | None

    @property
    def label(self) -> str: ...

    def run(self, ctx: BenchContext, prompt: torch.Tensor, max_new_tokens: int,
            params: SamplingParams, prompt_key: str = "") -> RunOutput: ...


def _label(name: str, settings: dict) -> str:
    shown = {k: v for k, v in settings.items() if k not in ("schedule", "confidence_threshold")}
    return name + (" " + ",".join(f"{k}={v}" for k, v in shown.items()) if shown else "")


class EngineMethod:
    """Our decode loop with a drafter (or none) and an optional acceptance rule."""

    kind = "quickdraft"

    def __init__(self, name: str, drafter_factory: Callable[[BenchContext], object] | None,
                 k: int | None = None, settings: dict | None = None,
                 acceptance: Callable[[SamplingParams], AcceptanceRule] | None = None) -> None:
        self.name = name
        self.k = k
        self.settings = dict(settings or ({"k": k} if k else {}))
        self._factory = drafter_factory
        self._drafter = None
        self._acceptance = acceptance

    @property
    def label(self) -> str:
        return _label(self.name, self.settings)

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
    """transformers ``generate()``, plain or with ``assistant_model`` (same draft, same k,
    constant schedule, confidence threshold 0)."""

    kind = "transformers"

    def __init__(self, name: str, k: int | None = None) -> None:
        self.name = name
        self.k = k
        self.settings = {"k": k, "schedule": "constant", "confidence_threshold": 0} if k else {}

    @property
    def label(self) -> str:
        return _label(self.name, self.settings)

    def _generate(self, ctx, prompt, max_new_tokens, params):
        from transformers import GenerationConfig

        target = ctx.hf_model("target")
        kwargs = {}
        if self.k:
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
        ids = prompt.view(1, -1)
        with torch.inference_mode():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, **kwargs)
        return out[0, ids.shape[1]:].tolist()

    def _prefill_sample(self, ctx, prompt, params) -> float:
        """Seconds of ``generate(max_new_tokens=1)`` (plus, for hf-assisted, one assistant
        forward pass over the prompt, which transformers runs inside its first step)."""
        started = time.perf_counter()
        self._generate(ctx, prompt, 1, params)
        if self.k:
            with torch.inference_mode():
                ctx.hf_model("draft")(prompt.view(1, -1), use_cache=True)
        return time.perf_counter() - started

    def run(self, ctx, prompt, max_new_tokens, params, prompt_key=""):
        # One prefill sample per run (two on the first), kept per prompt: the decode time is
        # computed from their median when the results are summarised.
        key = ("hf-prefill", self.name, prompt_key or tuple(prompt.tolist()))
        samples = ctx.cache.setdefault(key, [])
        for _ in range(1 if samples else 2):
            samples.append(self._prefill_sample(ctx, prompt, params))
        target = ctx.hf_model("target")
        draft = ctx.hf_model("draft") if self.k else None
        t0, d0 = target._qd_counter["calls"], draft._qd_counter["calls"] if draft is not None else 0
        started = time.perf_counter()
        tokens = self._generate(ctx, prompt, max_new_tokens, params)
        total = time.perf_counter() - started
        t_calls = target._qd_counter["calls"] - t0
        d_calls = (draft._qd_counter["calls"] - d0) if draft is not None else None
        # Our engine leaves EOS out of the output; so do we here.
        eos = set(ctx.eos_token_ids)
        for i, t in enumerate(tokens):
            if t in eos:
                tokens = tokens[:i]
                break
        return RunOutput(tokens, 0.0, total, None, target_passes=t_calls, draft_passes=d_calls,
                         prefill_samples=samples)


# --- method registry -------------------------------------------------------------------------

MethodFactory = Callable[[BenchContext, BenchConfig, int], list]
METHODS: dict[str, MethodFactory] = {}


def register_method(name: str, factory: MethodFactory) -> None:
    """Add a benchmark method: ``factory(ctx, config, k)`` returns its rows (Method objects).
    ``k`` is the run's number of speculative tokens."""
    METHODS[name] = factory


def _need_draft(ctx: BenchContext, name: str) -> None:
    if ctx.draft is None:
        raise BenchError(f"method {name!r} needs a draft model; pass --draft PATH")


def _draft_drafter(ctx: BenchContext):
    return DraftModelDrafter(ctx.draft, ctx.target.vocab_size)


def _ar(ctx, config, k):
    return [EngineMethod("ar", None)]


def _draft(ctx, config, k):
    _need_draft(ctx, "draft")
    ks = sorted({k, *config.sweep})
    return [EngineMethod("draft", _draft_drafter, s) for s in ks]


def _hf_ar(ctx, config, k):
    return [HFMethod("hf-ar")]


def _hf_assisted(ctx, config, k):
    _need_draft(ctx, "hf-assisted")
    return [HFMethod("hf-assisted", k)]


register_method("ar", _ar)
register_method("draft", _draft)
register_method("hf-ar", _hf_ar)
register_method("hf-assisted", _hf_assisted)


# Token trees, multi-draft and n-gram drafting (issue 10): one row per setting worth comparing.
def _drafter_rows(method: str, variants: list[dict], need_draft: bool = True) -> MethodFactory:
    """Rows of ``method`` built by ``make_drafter``; a variant's ``rule`` (spectr) only
    applies when sampling and is skipped for greedy runs."""
    from ..drafters import DraftOptions, make_drafter

    def factory(ctx, config, k):
        if need_draft:
            _need_draft(ctx, method)
        rows = []
        for settings in variants:
            rule = settings.get("rule", "mss")
            if rule != "mss" and config.temperature == 0:
                continue
            options = DraftOptions(**{key: v for key, v in settings.items() if key != "rule"})
            rows.append(EngineMethod(
                method, lambda c, o=options: make_drafter(method, c.draft, c.target.vocab_size, o), k,
                settings={"k": k, **settings}, acceptance=lambda params, r=rule: r))
        return rows

    return factory


register_method("ngram", _drafter_rows("ngram", [{"ngram_max": 3}], need_draft=False))
register_method("tree", _drafter_rows("tree", [{"tree": "2,1,1"}, {"tree": "2,2,1"}, {"tree": "dynamic:6"}]))
register_method("multi-draft", _drafter_rows("multi-draft", [{"num_drafts": 2}, {"num_drafts": 2, "rule": "spectr"}]))
register_method("hybrid", _drafter_rows("hybrid", [{"ngram_max": 3}]))


# --- the measurement loop --------------------------------------------------------------------


def cpu_model() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``), else the machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(threads: int | None = None) -> dict:
    import transformers

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": threads or torch.get_num_threads(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": "cpu",
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def encode_prompts(ctx: BenchContext, prompts: Sequence[BenchPrompt], room: int) -> list[torch.Tensor]:
    """Token ids of every prompt, keeping the end of a prompt that leaves less than ``room``
    tokens of context for generation."""
    limit = ctx.target.context_length - room
    if limit < 1:
        raise BenchError(
            f"--max-new-tokens leaves no room for a prompt in the model's {ctx.target.context_length}-token context"
        )
    out = []
    for p in prompts:
        ids = ctx.tokenizer(p.prompt)["input_ids"]
        out.append(torch.tensor(ids[-limit:] or [ctx.eos_token_ids[0] if ctx.eos_token_ids else 0]))
    return out


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _first_mismatch(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):  # lengths may differ
        if x != y:
            return i
    return min(len(a), len(b))


def run_benchmark(
    ctx: BenchContext,
    prompts: Sequence[BenchPrompt],
    config: BenchConfig,
    log: Callable[[str], None] = lambda msg: None,
) -> dict:
    """Run every method on every prompt; returns ``{"machine", "config", "results", ...}``."""
    if config.repeats < 1:
        raise BenchError(f"--repeats must be >= 1, got {config.repeats}")
    if config.max_new_tokens < 1:
        raise BenchError(f"--max-new-tokens must be >= 1, got {config.max_new_tokens}")
    unknown = [m for m in config.methods if m not in METHODS]
    if unknown:
        raise BenchError(f"unknown method {unknown[0]!r}; choose from: {', '.join(METHODS)}")
    if not prompts:
        raise BenchError("no prompts to run")
    if config.threads:
        torch.set_num_threads(config.threads)
    methods_requested = list(dict.fromkeys(["ar", *config.methods]))  # ar is the baseline
    greedy = config.temperature == 0
    needs_k = any(m != "ar" for m in methods_requested)
    max_sweep = max(config.sweep, default=0)
    room = config.max_new_tokens + max(config.k or 0, max_sweep, 8) + 2
    prompt_ids = encode_prompts(ctx, prompts, room)

    # 1. k: given, or the cost model's choice from a calibration run on the first prompts.
    k = config.k
    calibration = None
    if k is None and needs_k:
        if ctx.draft is not None:
            calibration = calibrate(ctx.target, ctx.draft, ctx.tokenizer, prompt_ids[:3],
                                    probe_k=8, max_k=8, calibration_tokens=min(64, config.max_new_tokens),
                                    params=SamplingParams(temperature=config.temperature, seed=config.seed))
            k = calibration.k
            log(f"k = {k} (cost model, predicted {calibration.predicted_speedup:.2f}x)")
        else:
            k = 4
    k = k or 4

    rows: list = []
    for name in methods_requested:
        rows.extend(METHODS[name](ctx, config, k))
    seen = set()
    rows = [r for r in rows if not (r.label in seen or seen.add(r.label))]

    # 2. Warm-up: one short run of every row.
    def params_for(pi: int, rep: int) -> SamplingParams:
        return SamplingParams(temperature=config.temperature, seed=config.seed + 1000 * pi + rep)

    for row in rows:
        log(f"warm-up {row.label}")
        row.run(ctx, prompt_ids[0], min(config.warmup_tokens, config.max_new_tokens), params_for(0, 0),
                "warm-up:" + prompts[0].id)

    # 3. Step costs at a realistic context (median prompt + half the new tokens), sampled
    #    before the timed runs and again after every (repeat, prompt), medians at the end.
    verify_sizes = sorted({1, 2, *(r.k + 1 for r in rows if r.k), *range(2, max(max_sweep, k) + 2)})
    context_len = int(statistics.median(p.numel() for p in prompt_ids)) + config.max_new_tokens // 2
    sampler = StepCostSampler(ctx.target, ctx.draft, torch.cat(prompt_ids), verify_sizes, context_len)
    sampler.sample(1, record=False)
    sampler.sample(3)
    early = sampler.costs()
    log(f"step costs: target {early.t_ar * 1e3:.2f} ms, draft {early.t_draft * 1e3:.2f} ms, "
        f"verify({k + 1}) {early.t_verify(k + 1) * 1e3:.2f} ms")

    # 4. Timed runs, methods alternating in a rotating order.
    results: dict[str, list[list[RunOutput]]] = {r.label: [[] for _ in prompts] for r in rows}
    order_base = list(range(len(rows)))
    total = config.repeats * len(prompts)
    done = 0
    for rep in range(config.repeats):
        for pi, ids in enumerate(prompt_ids):
            shift = (rep * len(prompts) + pi) % len(rows)
            order = order_base[shift:] + order_base[:shift]
            for ri in order:
                row = rows[ri]
                out = row.run(ctx, ids, config.max_new_tokens, params_for(pi, rep), prompts[pi].id)
                results[row.label][pi].append(out)
            sampler.sample(1)
            done += 1
            log(f"[{done}/{total}] repeat {rep + 1} prompt {prompts[pi].id}")
    costs = sampler.costs()

    # 5. Rows.
    reference = results[rows[0].label]  # ar
    ar_tps = [_median([o.tokens_per_second for o in runs]) for runs in reference]
    ar_e2e = [_median([o.e2e_tokens_per_second for o in runs]) for runs in reference]
    ar_step = _median([o.decode_seconds / o.stats.decode_passes
                       for runs in reference for o in runs if o.stats and o.stats.decode_passes])
    mismatch_report: list[str] = []
    out_rows = []
    for row in rows:
        runs = results[row.label]
        flat = [o for per in runs for o in per]
        tps = _median([o.tokens_per_second for o in flat])
        e2e = _median([o.e2e_tokens_per_second for o in flat])
        speedups = [_median([o.tokens_per_second for o in per]) / base
                    for per, base in zip(runs, ar_tps, strict=True) if base]
        e2e_speedups = [_median([o.e2e_tokens_per_second for o in per]) / base
                        for per, base in zip(runs, ar_e2e, strict=True) if base]
        # acceptance, pooled over runs
        pooled = GenerationStats()
        passes = hf_tokens = drafted = ours_tokens = 0
        for o in flat:
            if o.stats is not None:
                pool_stats(pooled, o.stats)
                ours_tokens += o.stats.new_tokens
            elif o.target_passes:
                passes += o.target_passes
                hf_tokens += o.new_tokens
                drafted += o.draft_passes or 0
        if pooled.target_forward_passes:
            tau = ours_tokens / pooled.target_forward_passes
            acceptance_rate = pooled.acceptance_rate if pooled.drafted_tokens else None
            per_position = pooled.per_position_acceptance
        elif passes:
            tau = hf_tokens / passes
            accepted = hf_tokens - passes
            acceptance_rate = (accepted / drafted) if (row.k and drafted) else None
            per_position = None
        else:
            tau, acceptance_rate, per_position = None, None, None
        # lossless
        lossless = None
        mismatches = []
        if greedy:
            lossless = True
            for pi, per in enumerate(runs):
                ref = reference[pi][0].tokens
                for rep, o in enumerate(per):
                    if o.tokens != ref:
                        lossless = False
                        at = _first_mismatch(o.tokens, ref)
                        mismatches.append({"prompt": prompts[pi].id, "repeat": rep, "first_mismatch": at,
                                           "tokens": len(o.tokens), "reference_tokens": len(ref)})
            for m in mismatches[:5]:
                mismatch_report.append(
                    f"MISMATCH {row.label}: prompt {m['prompt']} repeat {m['repeat']}: first differs at "
                    f"token {m['first_mismatch']} ({m['tokens']} vs {m['reference_tokens']} tokens from ar)")
            if len(mismatches) > 5:
                mismatch_report.append(f"MISMATCH {row.label}: ... {len(mismatches) - 5} more")
        # cost model
        row_k = row.k
        pred = eff = None
        breakdown = None
        step_costs = {"t_draft": costs.t_draft if row_k else None, "t_target": costs.t_ar,
                      "t_draft_k_steps": costs.t_drafting(row_k) if row_k else None,
                      "t_verify": costs.t_verify(row_k + 1) if row_k else None}
        measured_step = _median([o.decode_seconds / o.stats.decode_passes
                                 for o in flat if o.stats and o.stats.decode_passes])
        if row.kind == "quickdraft":
            if row_k and per_position is not None and row.name == "draft":
                pred = predicted_speedup(row_k, costs, per_position=per_position[:row_k])
                breakdown = where_time_goes(costs, row_k, measured_step)
            elif not row_k:
                pred = 1.0
                if measured_step is not None:
                    breakdown = {"k": 0, "verify_seconds": costs.t_ar, "measured_step_seconds": measured_step,
                                 "overhead_seconds": measured_step - costs.t_ar}
        speedup = _median(speedups)
        if pred and speedup is not None:
            eff = speedup / pred
        out_rows.append({
            "method": row.name,
            "settings": row.settings,
            "label": row.label,
            "k": row_k,
            "implementation": row.kind,
            "primary": row_k in (None, k),
            "tokens_per_second": tps,
            "e2e_tokens_per_second": e2e,
            "speedup": speedup,
            "e2e_speedup": _median(e2e_speedups),
            "mean_accepted_tokens": tau,
            "acceptance_rate": acceptance_rate,
            "per_position_acceptance": per_position,
            "lossless": lossless,
            "mismatches": mismatches,
            "step_costs": step_costs,
            "predicted_speedup": pred,
            "efficiency": eff,
            "step_breakdown": breakdown,
            "new_tokens_median": _median([o.new_tokens for o in flat]),
            "runs": len(flat),
            "per_prompt_speedup": {prompts[pi].id: s for pi, s in enumerate(speedups)} if len(speedups) == len(prompts) else None,
            "runs_by_prompt": {
                prompts[pi].id: [{"tokens_per_second": o.tokens_per_second, "new_tokens": o.new_tokens,
                                  "decode_seconds": o.decode_seconds, "total_seconds": o.total_seconds}
                                 for o in per]
                for pi, per in enumerate(runs)
            },
        })
    return {
        "machine": machine_info(config.threads),
        "config": {**config.to_json(), "k": k, "k_source": "given" if config.k else "cost model",
                   "model_dir": str(ctx.target_dir), "draft_dir": str(ctx.draft_dir) if ctx.draft_dir else None,
                   "prompts": [{"id": p.id, "kind": p.kind, "source": p.source, "tokens": int(ids.numel())}
                               for p, ids in zip(prompts, prompt_ids, strict=True)],
                   "ar_step_seconds": ar_step,
                   "definitions": DEFINITIONS},
        "step_costs": costs.to_dict(),
        "calibration": None if calibration is None else {
            "k": calibration.k, "per_position": calibration.per_position,
            "predicted": {str(kk): v for kk, v in calibration.predicted.items()}},
        "results": out_rows,
        "mismatches": mismatch_report,
    }


DEFINITIONS = {
    "tokens_per_second": "new tokens / decode seconds (prefill excluded); transformers rows: "
                         "generate() time minus a separately measured generate(max_new_tokens=1) "
                         "(+ one assistant pass over the prompt for hf-assisted)",
    "e2e_tokens_per_second": "new tokens / total seconds including prefill",
    "speedup": "median over prompts of (median over repeats of the row's tokens/s) / (same for ar)",
    "mean_accepted_tokens": "new tokens / target passes, the prefill included (ar = 1; the first "
                            "pass of draft and hf-assisted also verifies a draft); transformers "
                            "rows count target forward calls with a hook",
    "acceptance_rate": "accepted draft tokens / drafted tokens (hf-assisted: assistant forward calls "
                       "as drafted tokens)",
    "per_position_acceptance": "P(draft position i accepted), pooled over all runs",
    "lossless": "greedy: token-identical to ar on every prompt and repeat; null when sampling",
    "predicted_speedup": "cost model: (1 + sum_{i<k} a_i) * T_ar / (k * T_draft + T_verify(k+1)), "
                         "from measured a_i and step costs, no overhead term",
    "efficiency": "speedup / predicted_speedup",
}


def load_context(model: str | None, draft: str | None, need_draft: bool, backend: str = "native") -> BenchContext:
    """Load the target (default: the embedded default), its tokenizer and the draft (default:
    the embedded paired draft) for a benchmark."""
    from ..generator import check_same_tokenizer, load_tokenizer
    from ..models.loading import resolve_pair

    target_dir, draft_dir = resolve_pair(model, draft, need_draft)
    target = load_model(target_dir, backend)
    tokenizer = load_tokenizer(target_dir)
    draft_lm = None
    if draft_dir is not None:
        check_same_tokenizer(tokenizer, load_tokenizer(draft_dir), str(target_dir), str(draft_dir))
        draft_lm = load_model(draft_dir, backend)
    return BenchContext(target, tokenizer, draft_lm, target_dir, draft_dir)


__all__ = [
    "BenchConfig", "BenchContext", "BenchError", "DEFINITIONS", "EngineMethod", "HFMethod", "METHODS",
    "Method", "RunOutput", "StepCosts", "load_context", "register_method", "run_benchmark",
]
