"""From timed runs to result rows: what a run measured (:class:`RunOutput`), the row
summaries (tokens/s, speedup, tau, acceptance, losslessness, cost model) and their
definitions."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from ..decoding.stats import GenerationStats
from ..policy.cost_model import StepCosts, predicted_speedup, where_time_goes
from ..policy.timing import noise_limit


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


MIN_TIMED_TOKENS = 2  # fewer new tokens give no meaningful tokens/s

DEFINITIONS = {
    "tokens_per_second": "new tokens / decode seconds (prefill excluded); transformers rows: "
                         "generate() time minus a separately measured generate(max_new_tokens=1) "
                         "(+ one assistant pass over the prompt for hf-assisted)",
    "e2e_tokens_per_second": "new tokens / total seconds including prefill",
    "speedup": "median over prompts and repeats of the row's tokens/s / ar's tokens/s on the same "
               "prompt in the same repeat (the rows alternate within each (repeat, prompt))",
    "e2e_speedup": "the same with e2e tokens/s",
    "mean_accepted_tokens": "new tokens / target passes, the prefill included (ar = 1; the first "
                            "pass of draft and hf-assisted also verifies a draft); transformers "
                            "rows count target forward calls with a hook",
    "acceptance_rate": "accepted draft tokens / drafted tokens (hf-assisted: assistant forward calls "
                       "as drafted tokens)",
    "per_position_acceptance": "P(draft position i accepted), pooled over all runs",
    "lossless": "greedy: token-identical to ar on every prompt and repeat; null when sampling",
    "greedy_agreement": "llama.cpp rows: prompts whose generated text is the text of ar's tokens, "
                        "and for the others the index of ar's first token the text does not continue",
    "llama_cpp": "llama.cpp rows run its binaries on the same prompts and weights (GGUF), same threads, "
                 "same KV cache type (f32; f16 with --kv-cache float16); tokens/s = generated tokens / its "
                 "decode seconds (llama-completion: eval + sampling time; llama-speculative-simple: its "
                 "decode loop's wall time); tau = "
                 "tokens per target pass after the prompt; process start and model load excluded",
    "predicted_speedup": "cost model: (1 + sum_{i<k} a_i) * T_ar / (k * T_draft + T_verify(k+1)), "
                         "from measured a_i and step costs, no overhead term",
    "efficiency": "speedup / predicted_speedup",
    "overall": "the headline: each row summarised over the runs of all categories together "
               "(medians over all their prompts and repeats); no cost model there (step costs are "
               "measured per category)",
    "truncated": "a prompt longer than the model's context allows with room for the new tokens "
                 "keeps its end (its last config.max_prompt_tokens tokens), as --truncate-prompt does",
    "spread": "min, quartiles (q1, q3), median and max of a figure over the runs (prompts x "
              "repeats; per-run tau for mean_accepted_tokens)",
    "too_noisy": "figures of a row too noisy to trust, and why (printed as 'too noisy' instead of "
                 "numbers; the JSON keeps them): a predicted speedup above its bound k + 1, an "
                 "overhead below -25% of the measured step, or step-cost timings whose spread is "
                 "over the noise limit",
}

#: What the report prints instead of a figure too noisy to trust.
TOO_NOISY = "too noisy to trust (re-run on a quiet machine)"
#: How far below zero an overhead may go before it is noise, as a share of the measured
#: step: on a quiet machine the sampled model calls come out a few percent dearer than the
#: same calls in the decode loop (ar overhead -0.4 ms of a 6.7 ms step), under load they
#: can be off by anything (-440.88 ms).
OVERHEAD_TOLERANCE = 0.25


def median(values):
    """The median of the values that are not None (None if there are none)."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def spread(values) -> dict | None:
    """``{"min", "q1", "median", "q3", "max", "n"}`` of the values that are not None."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return {"min": values[0], "q1": q1, "median": statistics.median(values), "q3": q3,
            "max": values[-1], "n": len(values)}


def _run_tau(o: RunOutput) -> float | None:
    if o.stats is not None:
        return o.stats.mean_accepted_tokens if o.stats.target_forward_passes else None
    return o.new_tokens / o.target_passes if o.target_passes else None


def first_mismatch(a: list[int], b: list[int]) -> int:
    """Index of the first token where ``a`` and ``b`` differ (the shorter length if one is a
    prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):  # lengths may differ
        if x != y:
            return i
    return min(len(a), len(b))


def _acceptance(row, flat: list[RunOutput]):
    """(tau, acceptance rate, per-position acceptance) pooled over runs."""
    pooled = GenerationStats()
    passes = hf_tokens = drafted = ours_tokens = 0
    for o in flat:
        if o.stats is not None:
            pooled.merge(o.stats)
            ours_tokens += o.stats.new_tokens
        elif o.target_passes:
            passes += o.target_passes
            hf_tokens += o.new_tokens
            drafted += o.draft_passes or 0
    if pooled.target_forward_passes:
        tau = ours_tokens / pooled.target_forward_passes
        return tau, (pooled.acceptance_rate if pooled.drafted_tokens else None), pooled.per_position_acceptance
    if passes:
        accepted = hf_tokens - passes
        return hf_tokens / passes, ((accepted / drafted) if (row.k and drafted) else None), None
    return None, None, None


def _mismatches(row, runs, reference, prompt_ids: Sequence[str]) -> tuple[list[dict], list[str]]:
    """Runs whose tokens differ from ar's (greedy): one dict each, and report lines."""
    mismatches = []
    for pi, per in enumerate(runs):
        ref = reference[pi][0].tokens
        for rep, o in enumerate(per):
            if o.tokens != ref:
                mismatches.append({"prompt": prompt_ids[pi], "repeat": rep,
                                   "first_mismatch": first_mismatch(o.tokens, ref),
                                   "tokens": len(o.tokens), "reference_tokens": len(ref)})
    lines = [f"MISMATCH {row.label}: prompt {m['prompt']} repeat {m['repeat']}: first differs at "
             f"token {m['first_mismatch']} ({m['tokens']} vs {m['reference_tokens']} tokens from ar)"
             for m in mismatches[:5]]
    if len(mismatches) > 5:
        lines.append(f"MISMATCH {row.label}: ... {len(mismatches) - 5} more")
    return mismatches, lines


def _cost_model(row, costs: StepCosts | None, per_position, flat: list[RunOutput]):
    """(predicted speedup, where a step's time goes, the step costs) of a row; Nones where
    the cost model does not apply (transformers rows, no step costs)."""
    if costs is None:
        return None, None, None
    k = row.k
    step_costs = {"t_draft": costs.t_draft if k else None, "t_target": costs.t_ar,
                  "t_draft_k_steps": costs.t_drafting(k) if k else None,
                  "t_verify": costs.t_verify(k + 1) if k else None}
    if row.kind != "quickdraft":
        return None, None, step_costs
    measured_step = median([o.decode_seconds / o.stats.decode_passes
                            for o in flat if o.stats and o.stats.decode_passes])
    if k and per_position is not None and row.name == "draft":
        return (predicted_speedup(k, costs, per_position=per_position[:k]),
                where_time_goes(costs, k, measured_step), step_costs)
    if not k:
        breakdown = None if measured_step is None else {
            "k": 0, "verify_seconds": costs.t_ar, "measured_step_seconds": measured_step,
            "overhead_seconds": measured_step - costs.t_ar}
        return 1.0, breakdown, step_costs
    return None, None, step_costs


def too_noisy(k: int | None, predicted: float | None, breakdown: dict | None,
              costs_spread: float | None = None) -> dict[str, str]:
    """The cost-model figures of a row that timing noise has made meaningless, and why:
    a predicted speedup above k + 1 (a step emits at most k + 1 tokens and costs at least a
    plain one), an overhead below -:data:`OVERHEAD_TOLERANCE` of the step (a step measured
    much faster than the model calls it is made of), or step-cost timings spreading more
    than the noise limit (``costs_spread``, :func:`~quickdraft.policy.timing.spread_of`)."""
    out: dict[str, str] = {}
    if costs_spread is not None and costs_spread > noise_limit():
        why = f"step-cost timings spread {costs_spread:.0%}"
        if predicted is not None and k:
            out["predicted_speedup"] = why
        if breakdown is not None and "overhead_seconds" in breakdown:
            out["overhead"] = why
    if predicted is not None and k and predicted > k + 1:
        out["predicted_speedup"] = "above its bound k + 1"
    if breakdown is not None and "overhead_seconds" in breakdown and (
            breakdown["overhead_seconds"] < -OVERHEAD_TOLERANCE * breakdown["measured_step_seconds"]):
        out["overhead"] = f"negative, over {OVERHEAD_TOLERANCE:.0%} of the step"
    return out


def summarise(rows, results: dict[str, list[list[RunOutput]]], prompt_ids: Sequence[str],
              costs: StepCosts | None, k: int, greedy: bool,
              costs_spread: float | None = None) -> tuple[list[dict], list[str]]:
    """One dict per row (see :data:`DEFINITIONS`) and the mismatch report lines.

    ``results[label][prompt][repeat]`` holds the runs; the first row is ``ar``, the reference.
    Without ``costs`` (step costs measured for these prompts) there is no cost model;
    ``costs_spread`` is how noisy their timings were (see :func:`too_noisy`).
    """
    reference = results[rows[0].label]
    mismatch_report: list[str] = []
    out_rows = []
    for row in rows:
        runs = results[row.label]
        flat = [o for per in runs for o in per]
        # Pair each run with ar's run of the same prompt and repeat.
        pairs = [(o, base) for per, ref in zip(runs, reference, strict=True)
                 for o, base in zip(per, ref, strict=False)]
        speedups = [o.tokens_per_second / b.tokens_per_second for o, b in pairs if b.tokens_per_second]
        e2e_speedups = [o.e2e_tokens_per_second / b.e2e_tokens_per_second
                        for o, b in pairs if b.e2e_tokens_per_second]
        per_prompt = [median([o.tokens_per_second / b.tokens_per_second
                              for o, b in zip(per, ref, strict=False) if b.tokens_per_second])
                      for per, ref in zip(runs, reference, strict=True)]
        tau, acceptance_rate, per_position = _acceptance(row, flat)
        lossless, mismatches = None, []
        if greedy and row.kind != "llama.cpp":  # llama.cpp's text is compared by its runner
            mismatches, lines = _mismatches(row, runs, reference, prompt_ids)
            lossless = not mismatches
            mismatch_report += lines
        pred, breakdown, step_costs = _cost_model(row, costs, per_position, flat)
        speedup = median(speedups)
        eff = speedup / pred if pred and speedup is not None else None
        # A run that ends at once (EOS first) has no decode rate: leave it out of tok/s.
        timed = [o for o in flat if o.new_tokens >= MIN_TIMED_TOKENS]
        out_rows.append({
            "method": row.name,
            "settings": row.settings,
            "label": row.label,
            "k": row.k,
            "implementation": row.kind,
            "speculative": row.speculative,
            "primary": row.k in (None, k),
            "tokens_per_second": median([o.tokens_per_second for o in timed]),
            "spread": {
                "tokens_per_second": spread(o.tokens_per_second for o in timed),
                "e2e_tokens_per_second": spread(o.e2e_tokens_per_second for o in timed),
                "speedup": spread(speedups),
                "e2e_speedup": spread(e2e_speedups),
                "mean_accepted_tokens": spread(_run_tau(o) for o in flat),
            },
            "e2e_tokens_per_second": median([o.e2e_tokens_per_second for o in timed]),
            "speedup": speedup,
            "e2e_speedup": median(e2e_speedups),
            "mean_accepted_tokens": tau,
            "acceptance_rate": acceptance_rate,
            "per_position_acceptance": per_position,
            "lossless": lossless,
            "mismatches": mismatches,
            "step_costs": step_costs,
            "predicted_speedup": pred,
            "efficiency": eff,
            "step_breakdown": breakdown,
            "too_noisy": too_noisy(row.k, pred, breakdown, costs_spread),
            "new_tokens_median": median([o.new_tokens for o in flat]),
            "runs": len(flat),
            "per_prompt_speedup": {prompt_ids[pi]: s for pi, s in enumerate(per_prompt)},
            "runs_by_prompt": {
                prompt_ids[pi]: [{"tokens_per_second": o.tokens_per_second, "new_tokens": o.new_tokens,
                                  "decode_seconds": o.decode_seconds, "total_seconds": o.total_seconds}
                                 for o in per]
                for pi, per in enumerate(runs)
            },
        })
    return out_rows, mismatch_report


def slower_than_plain(overall: Sequence[dict], groups: Sequence[dict] = ()) -> list[str]:
    """One line for each speculative row slower than plain decoding overall or in a category
    (``groups``: ``{"category", "rows"}``)."""
    lines = []
    for r in overall:
        if not r.get("speculative"):
            continue
        slow = [(g["category"], row["speedup"]) for g in groups for row in g["rows"]
                if row["label"] == r["label"] and row.get("speedup") is not None and row["speedup"] < 1]
        overall_slow = r.get("speedup") is not None and r["speedup"] < 1
        if not slow and not overall_slow:
            continue
        where = ", ".join(f"{c} {s:.2f}x" for c, s in slow)
        if overall_slow:
            lines.append(f"{r['label']} is slower than plain decoding (ar) in this run: {r['speedup']:.2f}x "
                         "its tokens/s (median over all categories)" + (f"; {where}" if where else ""))
        else:
            lines.append(f"{r['label']} is slower than plain decoding (ar) on {where} "
                         f"({r['speedup']:.2f}x over all categories)")
    return lines


def unmeasured_prompts(groups: Sequence[dict]) -> list[str]:
    """One line for each prompt after which the reference row (the first: plain decoding)
    wrote no token in any run: the target ends it at once, so it has no speedup and its
    category is measured on its other prompts only."""
    lines = []
    for g in groups:
        reference = g["rows"][0] if g["rows"] else {}
        for pid, runs in (reference.get("runs_by_prompt") or {}).items():
            if runs and not any(run["new_tokens"] for run in runs):
                lines.append(f"{g['category']}: {reference['label']} wrote no token after prompt {pid} (the target "
                             "ends there), so it adds nothing to the category's figures; use prompts it continues")
    return lines


def noisy_figures(groups: Sequence[dict]) -> list[str]:
    """One line for each category whose cost-model figures were too noisy to trust:
    ``long: the predicted speedup of draft k=4 (above its bound k + 1); the overhead of ar,
    draft k=4 (negative): too noisy to trust (re-run on a quiet machine)``."""
    lines = []
    for g in groups:
        rows_by_reason: dict[tuple[str, str], list[str]] = {}
        for r in g["rows"]:
            for figure, why in (r.get("too_noisy") or {}).items():
                rows_by_reason.setdefault((figure, why), []).append(r["label"])
        if rows_by_reason:
            parts = [f"the {figure.replace('_', ' ')} of {', '.join(labels)} ({why})"
                     for (figure, why), labels in sorted(rows_by_reason.items())]
            lines.append(f"{g['category']}: {'; '.join(parts)}: {TOO_NOISY}")
    return lines
