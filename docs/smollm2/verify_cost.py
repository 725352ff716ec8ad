"""What a verify pass of m tokens costs SmolLM2 on this CPU, against a one-token step.

    PYTHONPATH=. python docs/smollm2/verify_cost.py [--rows 1,2,3,4,5,7] [--repeats 6]

One process, the target as `--model smollm2-135m` loads it (int4 layers, int8 LM head), a
300-token context; each pass feeds m random tokens after it and drops them again, logits
for every row (what a tree's verify needs). Prints the fastest of the repeats (10 passes
each) per m: a chain of k drafts is verified by k + 1 rows, a static tree `2,1` (4 nodes)
by 5. Take the CPU lock first (`flock /tmp/quickdraft-cpu.lock ...`).
"""

from __future__ import annotations

import argparse
import time

import torch

from quickdraft.generator import SpeculativeGenerator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,3,4,5,7")
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    target = SpeculativeGenerator.from_pretrained("smollm2-135m", method="ar").target
    torch.manual_seed(0)
    context = 300
    target.reset(context + 32)
    target.extend(torch.randint(100, 40000, (context,)), logits=1)
    rows = [int(m) for m in args.rows.split(",")]
    best = {m: float("inf") for m in rows}
    for _ in range(args.repeats):
        for m in rows:  # interleaved: drift in the machine's speed hits every m alike
            tokens = torch.randint(100, 40000, (m,))
            start = time.perf_counter()
            for _ in range(10):
                target.extend(tokens, logits=m)
                target.compact(context, [])
            best[m] = min(best[m], (time.perf_counter() - start) / 10 * 1e3)
    for m in rows:
        print(f"{m} rows: {best[m]:.2f} ms ({best[m] / best[rows[0]]:.2f}x {rows[0]} row)")


if __name__ == "__main__":
    main()
