"""A/B in one process: a target's linears in float32 vs int8 / int4 (docs/quantization.md).

    python docs/bench/quant_ab.py --model smollm2-135m --modes none,int4 --tokens 32
    python docs/bench/quant_ab.py --modes none,int8,int4 --tokens 128 --json OUT

Loads one generator per ``--quantize`` mode (target and draft both quantized, as the CLI
does), then times plain (``ar``) and draft-model decoding (fixed k) on the same prompts,
rounds alternating the modes' order. Reports tokens/s per mode and method, and each
mode's greedy drift from the first mode: for every prompt, the first position where its
tokens differ (``None``: identical over all ``--tokens``).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from quickdraft.generator import SpeculativeGenerator

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import os\n\n\ndef list_python_files(root):\n",
    "The three primary colours are",
    "Write a short note to a colleague explaining why the meeting moved to Friday.",
    "class Stack:\n    def __init__(self):\n",
    "Once upon a time, in a village by the sea,",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--modes", default="none,int8,int4")
    parser.add_argument("--methods", default="ar,draft")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("-k", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    modes, methods, prompts = args.modes.split(","), args.methods.split(","), PROMPTS[: args.prompts]
    gens = {(mode, method): SpeculativeGenerator.from_pretrained(args.model, method=method, quantize=mode)
            for mode in modes for method in methods}
    seconds = {key: 0.0 for key in gens}
    tokens = {key: 0 for key in gens}
    outputs: dict[tuple, list[list[int]]] = {}
    for round_ in range(args.rounds):
        order = gens if round_ % 2 == 0 else dict(reversed(list(gens.items())))
        for (mode, method), gen in order.items():
            k = None if method == "ar" else args.k
            gen.generate(prompts[0], max_new_tokens=8, num_speculative_tokens=k)  # warm-up
            runs = []
            start = time.perf_counter()
            for prompt in prompts:
                out = gen.generate(prompt, max_new_tokens=args.tokens, num_speculative_tokens=k)
                runs.append(list(out.token_ids))
            seconds[mode, method] += time.perf_counter() - start
            tokens[mode, method] += sum(len(r) for r in runs)
            outputs[mode, method] = runs
    rows = []
    for (mode, method) in gens:
        base = outputs[modes[0], "ar"]
        drift = [next((i for i, (a, b) in enumerate(zip(r, ref)) if a != b), None)
                 for r, ref in zip(outputs[mode, method], base)]
        rows.append({"quantize": mode, "method": method, "tokens_per_s": tokens[mode, method] / seconds[mode, method],
                     "first_divergence_vs_" + modes[0]: drift})
    ar0 = {r["method"]: r["tokens_per_s"] for r in rows if r["quantize"] == modes[0]}
    for r in rows:
        r["ratio_vs_" + modes[0]] = r["tokens_per_s"] / ar0[r["method"]]
        print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
