"""A/B in one process: session 43's one-call passes and plain greedy chains against the way
before them (each pass through ``Transformer.forward``, plain decoding one pass a token).

    python docs/bench/one_call_ab.py [--model smollm2-135m] [--repeats 8] [ar eagle:2 hybrid-eagle:6]

Each ``METHOD[:K]`` decodes a chat and a code prompt through the model's chat template (128
tokens), ``--repeats`` times each way, alternating the order; "before" turns both off
(``Transformer.forward_call`` returning None, ``engine.PLAIN_CHAIN = 1``). Outputs must be
identical (both ways are plain greedy decoding's); the figure is the median tokens/s of each
way and their ratio, per prompt. Take the CPU lock first (``flock /tmp/quickdraft-cpu.lock``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's quickdraft
from quickdraft import SpeculativeGenerator  # noqa: E402
from quickdraft.decoding import engine  # noqa: E402
from quickdraft.models import transformer  # noqa: E402

PROMPTS = {"chat": "Give me three tips for staying focused while studying.",
           "code": "Write a Python function that returns the squares of a list."}
ONE_CALL = transformer.Transformer.forward_call
CHAIN = engine.PLAIN_CHAIN


def use_one_call(on: bool) -> None:
    transformer.Transformer.forward_call = ONE_CALL if on else (lambda self, cache: None)
    engine.PLAIN_CHAIN = CHAIN if on else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("methods", nargs="*", default=["ar", "eagle:2", "hybrid-eagle:6"])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(2)
    for spec in args.methods:
        method, _, k = spec.partition(":")
        gen = SpeculativeGenerator.from_pretrained(args.model, method=method)
        settings = {"max_new_tokens": args.max_new_tokens, **({"num_speculative_tokens": int(k)} if k else {})}
        rates: dict[tuple[str, str], list[float]] = {}
        texts: dict[str, str] = {}
        gen.generate(messages=[{"role": "user", "content": PROMPTS["chat"]}], **settings)  # warm
        for repeat in range(args.repeats):
            for way in ("before", "after") if repeat % 2 == 0 else ("after", "before"):
                use_one_call(way == "after")
                for name, prompt in PROMPTS.items():
                    started = time.perf_counter()
                    out = gen.generate(messages=[{"role": "user", "content": prompt}], **settings)
                    rates.setdefault((way, name), []).append(out.stats.new_tokens / (time.perf_counter() - started))
                    if texts.setdefault(name, out.text) != out.text:
                        raise SystemExit(f"{spec}, {name}: the output changed ({way}): a bug")
        use_one_call(True)
        cells = []
        for name in PROMPTS:
            before, after = (statistics.median(rates[(way, name)]) for way in ("before", "after"))
            cells.append(f"{name} {before:.0f} -> {after:.0f} tok/s ({after / before:.2f}x)")
        print(f"{spec:16s} " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
