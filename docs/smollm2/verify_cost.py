"""What a verify pass of m tokens costs SmolLM2 on this CPU, against a one-token step.

    PYTHONPATH=. python docs/smollm2/verify_cost.py [--rows 1,2,3,4,5,7] [--repeats 6]

One process, the target as `--model smollm2-135m` loads it (int4 layers, int8 LM head), a
300-token context; each pass feeds m random tokens after it and drops them again, logits
for every row (what a tree's verify needs). Prints the fastest of the repeats (10 passes
each) per m: a chain of k drafts is verified by k + 1 rows, a static tree `2,1` (4 nodes)
by 5. Then what the shipped EAGLE drafter's chain call costs for 1-3 levels (fed two
tokens first, as after a round that settled two): the rest of a round. Take the CPU lock
first (`flock /tmp/quickdraft-cpu.lock ...`).
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
    torch.set_grad_enabled(False)  # (our kernels run in inference)
    eagle = SpeculativeGenerator.from_pretrained("smollm2-135m", method="eagle")
    target, head = eagle.target, eagle.drafter.head
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
    sequence = torch.randint(100, 40000, (context,))
    states = torch.randn(context, target.config.hidden_size * len(head.feature_layers))
    cache = head.new_cache(context + 32, torch.float16)  # as the drafter keeps it on the CPU
    call = head.chain_call(target.model, cache)
    head.extend(sequence[:-2], head.from_target(torch.cat([states[:1] * 0, states[:-3]])), target.model, cache, 0, 0)
    drafted = {}
    for _ in range(args.repeats):
        for levels in (1, 2, 3):
            start = time.perf_counter()
            for _ in range(10):
                assert head.greedy_chain(sequence[-2:], states[-3:-1], levels, context, cache, target.model,
                                         raw=True, call=call) is not None
            drafted[levels] = min(drafted.get(levels, float("inf")), (time.perf_counter() - start) / 10 * 1e3)
    for levels, ms in drafted.items():
        print(f"EAGLE chain of {levels}: {ms:.2f} ms ({ms / best[rows[0]]:.2f}x {rows[0]} row)")


if __name__ == "__main__":
    main()
