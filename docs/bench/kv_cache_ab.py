"""A float32 vs a float16 KV cache (``--kv-cache float16``), pass by pass in one process:

    python docs/bench/kv_cache_ab.py [MODEL] [--quantize int8] [--contexts 128,1000,1900] [--widths 1,9]

Loads MODEL twice (default: smollm2-135m), one per cache type, fills both caches with the
same random context, then times passes of each width over it, alternating the two models
(this host's speed drifts between processes). Prints the median times and their ratio
(float16 / float32).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's quickdraft
from quickdraft.models.lm import load_model  # noqa: E402
from quickdraft.models.placement import resolve_placement  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    parser.add_argument("--quantize", default=None, choices=["int8", "int4"])
    parser.add_argument("--contexts", default="128,1000,1900")
    parser.add_argument("--widths", default="1,9")
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(2)
    models = {kv: load_model(args.model, placement=resolve_placement("cpu", None, args.quantize, kv))
              for kv in ("auto", "float16")}
    widths = [int(w) for w in args.widths.split(",")]
    gen = torch.Generator().manual_seed(0)
    for context in map(int, args.contexts.split(",")):
        prompt = torch.randint(0, 8000, (context,), generator=gen)
        for lm in models.values():
            lm.reset(context + max(widths))
            lm.extend(prompt, logits="none")
        for width in widths:
            tokens = torch.randint(0, 8000, (width,), generator=gen)
            times: dict[str, list[float]] = {kv: [] for kv in models}
            for i in range(args.rounds):
                for kv, lm in list(models.items())[:: 1 if i % 2 else -1]:
                    lm.crop(context)
                    start = time.perf_counter()
                    lm.extend(tokens, logits="all")
                    if i >= args.rounds // 6:  # the first rounds warm up
                        times[kv].append(time.perf_counter() - start)
            f32, f16 = (statistics.median(times[kv]) * 1e3 for kv in ("auto", "float16"))
            print(f"after {context} tokens, {width} token(s): float32 {f32:.2f} ms, float16 {f16:.2f} ms, "
                  f"ratio {f16 / f32:.3f}", flush=True)


if __name__ == "__main__":
    main()
