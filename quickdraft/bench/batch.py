"""``quickdraft bench --batch-size 1,4,8``: throughput of batched plain decoding against
batched speculative decoding, per prompt category.

For each category and batch size B, the category's prompts (cycled up to ``max(B, 4)``
requests) run through the batched engine with at most B rows at a time, once with plain
decoding and once per speculative method (k from the batch policy unless ``-k``; a head
method's, which has none, the k ``quickdraft serve`` settles for it, drafted with
several rows only where the engine's steps measure it faster than plain ones), the
methods alternating, ``repeats`` times. Throughput = new tokens of all requests / wall
time; the ratio is speculative over plain in the same run. Greedy rows are also checked
token for token against the plain rows.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

from ..batch_generate import make_batch_engine
from ..decoding.batch_engine import MAX_BATCH_K, BatchEngine
from ..decoding.sampling import SamplingParams
from ..decoding.stats import GenerationStats
from ..decoding.stopping import StopConditions
from ..drafters.factory import BATCH_METHODS
from ..drafters.per_row import HEAD_BATCH_K
from ..generator import SpeculativeGenerator
from .config import BenchConfig, BenchError
from .context import BenchContext, encode_prompts, stop_at_end_of_turn
from .prompts import BenchPrompt


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise BenchError(f"--batch-size must look like '1,4,8', got {text!r}") from None
    if not sizes or any(b < 1 or b > 64 for b in sizes):
        raise BenchError("--batch-size values must be between 1 and 64")
    return list(dict.fromkeys(sizes))


def _run(engine: BatchEngine, prompts, max_new_tokens: int, eos, params: SamplingParams):
    """All prompts through ``engine``: (tokens per prompt, seconds outside the prompts'
    prefill passes, the rows' stats pooled)."""
    waiting = list(range(len(prompts)))
    rows: dict[int, int] = {}
    out: list[list[int]] = [[] for _ in prompts]
    pooled = GenerationStats()
    prefill = engine.prefill_seconds
    started = time.perf_counter()
    while waiting or engine.active:
        while waiting and engine.free_slots:
            i = waiting.pop(0)
            rows[engine.add(prompts[i], params, StopConditions(max_new_tokens, eos))] = i
        for row, update in engine.step().items():
            out[rows[row]].extend(update.tokens)
            if update.finish:
                pooled.merge(update.stats)
    return out, time.perf_counter() - started - (engine.prefill_seconds - prefill), pooled


def run_batch_benchmark(ctx: BenchContext, prompts: Sequence[BenchPrompt], config: BenchConfig,
                        sizes: Sequence[int], log: Callable[[str], None] = lambda msg: None) -> dict:
    """Every (category, batch size): plain vs speculative throughput; see the module docstring."""
    import torch

    if config.threads:
        torch.set_num_threads(config.threads)
    methods = [m for m in config.methods if m != "ar"] or ["draft"]
    bad = [m for m in methods if m not in BATCH_METHODS]
    if bad:
        raise BenchError(f"--batch-size runs {', '.join(BATCH_METHODS)}; {bad[0]} is batch 1 only")
    room = config.max_new_tokens + MAX_BATCH_K + 2
    if any(p.is_chat for p in prompts):
        stop_at_end_of_turn(ctx)
    encoded = encode_prompts(ctx, prompts, room)
    categories: dict[str, list] = {}
    for p, e in zip(prompts, encoded):
        categories.setdefault(p.category, []).append(e.ids)
    max_len = max(e.ids.numel() for e in encoded) + room
    params = SamplingParams(config.temperature, seed=config.seed)
    first = next(iter(categories.values()))
    groups = {category: [] for category in categories}
    # A head method's rows have no batch policy: without -k they draft the k the server and
    # generate([...]) settle for it (the cost model's for eagle), not HEAD_BATCH_K, and decode
    # plainly with several rows where their steps measure that faster, as the server's do.
    head_ks = {} if config.k is not None else {
        m: SpeculativeGenerator.for_pair(ctx.target, ctx.draft, ctx.tokenizer, m, log=log).settled_k()
        for m in methods if m in HEAD_BATCH_K}
    for b in sizes:  # one batch size at a time: its engines' caches are freed after it
        engines = {}
        for m in ["ar", *methods]:
            k = 0 if m == "ar" else config.k if config.k is not None else head_ks.get(m)
            log(f"batch {b}: {m} engine" + (" (batch policy: costs measured once, then cached)" if k is None else ""))
            engines[m] = make_batch_engine(ctx.target, m, ctx.draft, max_batch_size=b, max_len=max_len,
                                           num_speculative_tokens=k, plain_when_faster=m in head_ks)
            _run(engines[m], first[:1], min(config.warmup_tokens, config.max_new_tokens), ctx.eos_token_ids,
                 params)  # warm-up
        for category, ids in categories.items():
            requests = [ids[i % len(ids)] for i in range(max(b, 4, len(ids)))]
            times: dict[str, list[float]] = {}
            runs: dict[str, tuple] = {}
            for rep in range(config.repeats):
                for m in (["ar", *methods] if rep % 2 == 0 else [*methods, "ar"]):
                    out, seconds, stats = _run(engines[m], requests, config.max_new_tokens, ctx.eos_token_ids, params)
                    times.setdefault(m, []).append(seconds)
                    runs[m] = (out, stats)
            plain_rate = runs["ar"][1].new_tokens / statistics.median(times["ar"])
            row = {"batch_size": b, "requests": len(requests), "ar_tokens_per_second": plain_rate, "methods": {}}
            for m in methods:
                out, stats = runs[m]
                rate = stats.new_tokens / statistics.median(times[m])
                row["methods"][m] = {
                    "tokens_per_second": rate,
                    "speedup": rate / plain_rate,
                    # What the policy used, not what it would pick at some context: the mean
                    # draft length over the steps (0 = plain decoding throughout).
                    "k": round(stats.drafted_tokens / max(1, stats.target_forward_passes), 2),
                    "mean_accepted_tokens": stats.mean_accepted_tokens,
                    "acceptance_rate": stats.acceptance_rate if stats.drafted_tokens else None,
                    "lossless": out == runs["ar"][0] if config.temperature == 0 else None,
                }
            groups[category].append(row)
            log(f"{category} batch {b}: ar {plain_rate:.1f} tok/s, "
                + ", ".join(f"{m} {v['tokens_per_second']:.1f} tok/s ({v['speedup']:.2f}x, mean k {v['k']})"
                            for m, v in row["methods"].items()))
        del engines
    groups = [{"category": c, "rows": rows} for c, rows in groups.items()]
    return {"batch_sizes": list(sizes), "methods": methods, "results": groups}


def print_batch_table(result: dict) -> None:
    methods = result["methods"]
    head = "| category | batch | ar tok/s | " + " | ".join(f"{m} tok/s | speedup | mean k | tau" for m in methods) + " |"
    print(head)
    print("|" + "---|" * (3 + 4 * len(methods)))
    for group in result["results"]:
        for row in group["rows"]:
            cells = [group["category"], str(row["batch_size"]), f"{row['ar_tokens_per_second']:.1f}"]
            for m in methods:
                v = row["methods"][m]
                mark = "" if v["lossless"] in (True, None) else " (MISMATCH)"
                cells += [f"{v['tokens_per_second']:.1f}", f"{v['speedup']:.2f}x{mark}", str(v["k"]),
                          f"{v['mean_accepted_tokens']:.2f}"]
            print("| " + " | ".join(cells) + " |")
