"""The measurement loop of ``quickdraft bench``.

Rules (docs/methods.md, "Benchmark rules"): same target, same prompts, same machine,
same process; a warm-up run per row first; batch 1; rows alternate within every
(repeat, prompt) in a rotating order so drift in machine speed hits all of them alike;
medians over prompts and repeats. The rows come from :mod:`.registry`, the summaries from
:mod:`.results`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from ..machine import machine_info
from ..sampling import SamplingParams
from .autok import StepCostSampler, calibrate
from .config import BenchConfig, BenchError
from .context import BenchContext, encode_prompts
from .prompts import BenchPrompt
from .registry import make_rows
from .results import DEFINITIONS, RunOutput, median, slower_than_plain, summarise

DEFAULT_K = 4  # without a draft to calibrate with


def _choose_k(ctx: BenchContext, config: BenchConfig, prompt_ids, log) -> tuple[int, object]:
    """k given, or the cost model's choice from a calibration run on the first prompts."""
    if config.k is not None:
        return config.k, None
    if ctx.draft is None:
        return DEFAULT_K, None
    calibration = calibrate(ctx.target, ctx.draft, ctx.tokenizer, prompt_ids[:3],
                            probe_k=8, max_k=8, calibration_tokens=min(64, config.max_new_tokens),
                            params=SamplingParams(temperature=config.temperature, seed=config.seed))
    log(f"k = {calibration.k} (cost model, predicted {calibration.predicted_speedup:.2f}x)")
    return calibration.k, calibration


def run_benchmark(
    ctx: BenchContext,
    prompts: Sequence[BenchPrompt],
    config: BenchConfig,
    log: Callable[[str], None] = lambda msg: None,
) -> dict:
    """Run every method on every prompt; returns ``{"machine", "config", "results", ...}``."""
    config.validate()
    if not prompts:
        raise BenchError("no prompts to run")
    if config.threads:
        torch.set_num_threads(config.threads)
    methods = list(dict.fromkeys(["ar", *config.methods]))  # ar is the baseline
    max_sweep = max(config.sweep, default=0)
    room = config.max_new_tokens + max(config.k or 0, max_sweep, 8) + 2
    prompt_ids = encode_prompts(ctx, prompts, room)
    k, calibration = _choose_k(ctx, config, prompt_ids, log)
    rows = make_rows(ctx, config, methods, k)

    def params_for(pi: int, rep: int) -> SamplingParams:
        return SamplingParams(temperature=config.temperature, seed=config.seed + 1000 * pi + rep)

    # Warm-up: one short run of every row.
    for row in rows:
        log(f"warm-up {row.label}")
        row.run(ctx, prompt_ids[0], min(config.warmup_tokens, config.max_new_tokens), params_for(0, 0),
                "warm-up:" + prompts[0].id)

    # Step costs at a realistic context (median prompt + half the new tokens), sampled
    # before the timed runs and again after every (repeat, prompt), medians at the end.
    verify_sizes = sorted({1, 2, *(r.k + 1 for r in rows if r.k), *range(2, max(max_sweep, k) + 2)})
    context_len = int(statistics.median(p.numel() for p in prompt_ids)) + config.max_new_tokens // 2
    sampler = StepCostSampler(ctx.target, ctx.draft, torch.cat(prompt_ids), verify_sizes, context_len)
    sampler.sample(1, record=False)
    sampler.sample(3)
    early = sampler.costs()
    log(f"step costs: target {early.t_ar * 1e3:.2f} ms, draft {early.t_draft * 1e3:.2f} ms, "
        f"verify({k + 1}) {early.t_verify(k + 1) * 1e3:.2f} ms")

    # Timed runs, rows alternating in a rotating order.
    results: dict[str, list[list[RunOutput]]] = {r.label: [[] for _ in prompts] for r in rows}
    total = config.repeats * len(prompts)
    done = 0
    for rep in range(config.repeats):
        for pi, ids in enumerate(prompt_ids):
            shift = (rep * len(prompts) + pi) % len(rows)
            for row in rows[shift:] + rows[:shift]:
                out = row.run(ctx, ids, config.max_new_tokens, params_for(pi, rep), prompts[pi].id)
                results[row.label][pi].append(out)
            sampler.sample(1)
            done += 1
            log(f"[{done}/{total}] repeat {rep + 1} prompt {prompts[pi].id}")
    costs = sampler.costs()

    out_rows, mismatch_report = summarise(rows, results, [p.id for p in prompts], costs, k,
                                          greedy=config.temperature == 0)
    ar_step = median([o.decode_seconds / o.stats.decode_passes
                      for runs in results[rows[0].label] for o in runs if o.stats and o.stats.decode_passes])
    return {
        "machine": {**machine_info(config.threads), "device": "cpu",
                    "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        "config": {**config.to_json(), "k": k, "k_source": "given" if config.k else "cost model",
                   "backend_requested": config.backend, "backend": ctx.target.backend,
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
        "warnings": slower_than_plain(out_rows),
    }
