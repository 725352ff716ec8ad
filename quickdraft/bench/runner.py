"""The measurement loop of ``quickdraft bench``.

Rules (docs/methods.md, "Benchmark rules"): same target, same prompts, same machine,
same process; a warm-up run per row first; batch 1; rows alternate within every
(repeat, prompt) in a rotating order so drift in machine speed hits all of them alike;
medians over prompts and repeats. Prompts of all categories run in one loop; results are
summarised per category and over all of them (the headline). The rows come from
:mod:`.registry`, the summaries from :mod:`.results`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from ..decoding.sampling import SamplingParams
from ..machine import device_info, machine_info
from ..policy.autok import StepCostSampler, calibrate
from .config import BenchConfig, BenchError
from .context import BenchContext, EncodedPrompt, encode_prompts, stop_at_end_of_turn
from .prompts import BenchPrompt
from .registry import make_rows
from .results import (
    DEFINITIONS,
    TOO_NOISY,
    RunOutput,
    median,
    noisy_figures,
    slower_than_plain,
    summarise,
    unmeasured_prompts,
)

DEFAULT_K = 4  # without a draft to calibrate with


def _choose_k(ctx: BenchContext, config: BenchConfig, prompt_ids, log) -> tuple[int, object]:
    """k given, or the cost model's choice from a calibration run on a few prompts."""
    if config.k is not None:
        return config.k, None
    if ctx.draft is None:
        return DEFAULT_K, None
    calibration = calibrate(ctx.target, ctx.draft, ctx.tokenizer, prompt_ids,
                            probe_k=8, max_k=8, calibration_tokens=min(64, config.max_new_tokens),
                            params=SamplingParams(temperature=config.temperature, seed=config.seed))
    noisy = calibration.noise is not None and calibration.noise.noisy
    if noisy or calibration.predicted_speedup > calibration.k + 1:
        log(f"k = {calibration.k} (cost model; its predicted speedup is {TOO_NOISY})")
    else:
        log(f"k = {calibration.k} (cost model, predicted {calibration.predicted_speedup:.2f}x)")
    return calibration.k, calibration


def _categories(prompts: Sequence[BenchPrompt]) -> dict[str, list[int]]:
    """Prompt indices per category, categories in order of first appearance."""
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        out.setdefault(p.category, []).append(i)
    return out


def _step_cost_samplers(ctx, categories, encoded: list[EncodedPrompt], verify_sizes, max_new_tokens):
    """One step-cost sampler per category, at its realistic context (median prompt + half
    the new tokens)."""
    samplers = {}
    for category, idx in categories.items():
        ids = [encoded[i].ids for i in idx]
        context_len = int(statistics.median(x.numel() for x in ids)) + max_new_tokens // 2
        samplers[category] = StepCostSampler(ctx.target, ctx.draft, torch.cat(ids), verify_sizes, context_len)
    return samplers


def run_benchmark(
    ctx: BenchContext,
    prompts: Sequence[BenchPrompt],
    config: BenchConfig,
    log: Callable[[str], None] = lambda msg: None,
) -> dict:
    """Run every method on every prompt; returns ``{"machine", "config", "results" (one
    group per category), "overall", ...}``."""
    config.validate()
    if not prompts:
        raise BenchError("no prompts to run")
    duplicate = next((p.id for i, p in enumerate(prompts) if p.id in {q.id for q in prompts[:i]}), None)
    if duplicate is not None:
        raise BenchError(f"two prompts have the id {duplicate!r}")
    if config.threads:
        torch.set_num_threads(config.threads)
    methods = list(dict.fromkeys(["ar", *config.methods]))  # ar is the baseline
    max_sweep = max(config.sweep, default=0)
    room = config.max_new_tokens + max(config.k or 0, max_sweep, 8) + 2
    if any(p.is_chat for p in prompts):
        stop_at_end_of_turn(ctx)
    ctx.chat_prompts = {p.id for p in prompts if p.is_chat}
    encoded = encode_prompts(ctx, prompts, room)
    prompt_ids = [e.ids for e in encoded]
    categories = _categories(prompts)
    for category, idx in categories.items():
        cut = [encoded[i] for i in idx if encoded[i].truncated]
        if cut:
            log(f"{category}: {len(cut)} of {len(idx)} prompts keep their last "
                f"{ctx.target.context_length - room} tokens (context {ctx.target.context_length})")
    k, calibration = _choose_k(ctx, config, [prompt_ids[idx[0]] for idx in categories.values()][:3], log)
    rows = make_rows(ctx, config, methods, k)

    def params_for(pi: int, rep: int) -> SamplingParams:
        return SamplingParams(temperature=config.temperature, seed=config.seed + 1000 * pi + rep)

    # Warm-up: one short run of every row.
    for row in rows:
        log(f"warm-up {row.label}")
        row.run(ctx, prompt_ids[0], min(config.warmup_tokens, config.max_new_tokens), params_for(0, 0),
                "warm-up:" + prompts[0].id)

    # Step costs, sampled before the timed runs and again after every (repeat, prompt),
    # medians at the end.
    verify_sizes = sorted({1, 2, *(r.k + 1 for r in rows if r.k), *range(2, max(max_sweep, k) + 2)})
    samplers = _step_cost_samplers(ctx, categories, encoded, verify_sizes, config.max_new_tokens)
    for category, sampler in samplers.items():
        sampler.sample(1, record=False)
        sampler.sample(3)
        early = sampler.costs()
        log(f"step costs ({category}): target {early.t_ar * 1e3:.2f} ms, draft {early.t_draft * 1e3:.2f} ms, "
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
            samplers[prompts[pi].category].sample(1)
            done += 1
            log(f"[{done}/{total}] repeat {rep + 1} {prompts[pi].category} prompt {prompts[pi].id}")

    greedy = config.temperature == 0
    groups = []
    for category, idx in categories.items():
        costs, costs_spread = samplers[category].costs(), samplers[category].spread()
        sub = {label: [runs[i] for i in idx] for label, runs in results.items()}
        group_rows, _ = summarise(rows, sub, [prompts[i].id for i in idx], costs, k, greedy, costs_spread)
        _llama_cpp_agreement(ctx, rows, group_rows, sub, [prompts[i].id for i in idx], greedy)
        groups.append({
            "category": category,
            "prompts": [prompts[i].id for i in idx],
            "prompt_tokens": [encoded[i].tokens for i in idx],
            "truncated_prompts": sum(encoded[i].truncated for i in idx),
            "step_costs": costs.to_dict(),
            "step_costs_spread": costs_spread,
            "rows": group_rows,
        })
    overall_rows, mismatch_report = summarise(rows, results, [p.id for p in prompts], None, k, greedy)
    _llama_cpp_agreement(ctx, rows, overall_rows, results, [p.id for p in prompts], greedy)
    for r in overall_rows:  # the per-prompt detail is in the category groups
        r.pop("runs_by_prompt", None)
        r.pop("per_prompt_speedup", None)
    ar_step = median([o.decode_seconds / o.stats.decode_passes
                      for runs in results[rows[0].label] for o in runs if o.stats and o.stats.decode_passes])
    return {
        "machine": {**machine_info(config.threads), **device_info(config.placement()),
                    "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        "config": {**config.to_json(), "k": k, "k_source": "given" if config.k else "cost model",
                   "backend_requested": config.backend, "backend": ctx.target.backend,
                   "model_dir": str(ctx.target_dir), "draft_dir": str(ctx.draft_dir) if ctx.draft_dir else None,
                   "context_length": ctx.target.context_length,
                   "max_prompt_tokens": ctx.target.context_length - room,
                   "categories": list(categories),
                   "prompts": [{"id": p.id, "category": p.category, "kind": p.kind, "size": p.size,
                                "source": p.source, "tokens": e.tokens, "tokens_used": int(e.ids.numel()),
                                "truncated": e.truncated}
                               for p, e in zip(prompts, encoded, strict=True)],
                   "ar_step_seconds": ar_step,
                   "definitions": DEFINITIONS},
        "calibration": None if calibration is None else {
            "k": calibration.k, "per_position": calibration.per_position,
            "predicted": {str(kk): v for kk, v in calibration.predicted.items()}},
        "results": groups,
        "overall": {"category": "all", "rows": overall_rows},
        "mismatches": mismatch_report,
        "warnings": (slower_than_plain(overall_rows, groups) + unmeasured_prompts(groups) + noisy_figures(groups)
                     + _llama_cpp_warnings(ctx)),
        **({"llama_cpp": ctx.llama_cpp.to_json()} if ctx.llama_cpp is not None else {}),
    }


def _llama_cpp_agreement(ctx, rows, out_rows, results, prompt_ids, greedy: bool) -> None:
    """Greedy runs: add to each llama.cpp row how its text agrees with ar's tokens."""
    if not greedy or not any(r.kind == "llama.cpp" for r in rows):
        return
    from .llama_cpp import greedy_agreement

    reference = results[rows[0].label]
    for row, out in zip(rows, out_rows, strict=True):
        if row.kind == "llama.cpp":
            out["greedy_agreement"] = greedy_agreement(results[row.label], reference, ctx.tokenizer, prompt_ids)


def _llama_cpp_warnings(ctx) -> list[str]:
    setup = ctx.llama_cpp
    differ = [pid for pid, same in (setup.prompt_ids_equal.items() if setup else []) if not same]
    if not differ:
        return []
    return [f"llama.cpp tokenized {len(differ)} prompt(s) differently from us ({', '.join(differ[:5])}): "
            "its rows ran other token ids there"]
