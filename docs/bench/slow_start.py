"""The slow start after a prefill: the time of each of the first plain steps after a
prompt, median over repeats (docs/step_cost.md, "Session 33").

    python docs/bench/slow_start.py [MODEL] [--context 200] [--steps 40] [--repeats 6]
"""

import argparse
import statistics
import time

import torch

from quickdraft.models.lm import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=200, help="prompt tokens prefilled before the steps")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    lm = load_model(args.model)
    prompt = torch.randint(0, lm.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))
    curves = []
    for _ in range(args.repeats):
        lm.reset(args.context + 2)
        lm.extend(prompt, logits="none")
        times = []
        for _ in range(args.steps):
            started = time.perf_counter()
            lm.extend(prompt[:1], logits="all")
            times.append((time.perf_counter() - started) * 1e3)
            lm.crop(args.context)
        curves.append(times)
    medians = [statistics.median(curve[i] for curve in curves) for i in range(args.steps)]
    print(f"plain step i after a {args.context}-token prefill, ms (median of {args.repeats}):")
    print(" ".join(f"{i + 1}:{m:.2f}" for i, m in enumerate(medians)))


if __name__ == "__main__":
    main()
