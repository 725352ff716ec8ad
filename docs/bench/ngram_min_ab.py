"""Prompt lookup with different shortest tails (``--ngram-min``), in one process: plain
decoding and n-gram decoding at each minimum, alternating per prompt, on every bench prompt
of the given categories (chat prompts through the model's template), 128 new tokens, k = 4,
2 rounds; asserts every row's tokens equal plain decoding's:

    python docs/bench/ngram_min_ab.py                                   # embedded pair
    python docs/bench/ngram_min_ab.py --model smollm2-135m --categories chat,code

Prints, per category, each row's speedup: plain decoding's total decode time over its.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from quickdraft.generator import DraftOptions, SpeculativeGenerator

BENCH = Path(__file__).resolve().parents[2] / "quickdraft" / "assets" / "bench"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--categories", default="short,long,out-of-domain")
    parser.add_argument("--mins", default="1,2,3")
    parser.add_argument("-k", type=int, default=4)
    args = parser.parse_args()
    gens = {"ar": SpeculativeGenerator.from_pretrained(args.model, method="ar")}
    for n in map(int, args.mins.split(",")):
        gens[f"ngram-min {n}"] = SpeculativeGenerator.from_pretrained(args.model, method="ngram",
                                                                      options=DraftOptions(ngram_min=n))
    categories = args.categories.split(",")
    prompts = [json.loads(line) for c in categories for line in open(BENCH / f"{c}.jsonl")]
    seconds = {c: dict.fromkeys(gens, 0.0) for c in categories}
    for rnd in range(2):
        for p in prompts:
            outs = {}
            for name in list(gens) if rnd % 2 == 0 else list(gens)[::-1]:
                kw = {"max_new_tokens": 128, "temperature": 0.0, **({} if name == "ar" else {"num_speculative_tokens": args.k})}
                gen = gens[name]
                outs[name] = gen.generate(messages=p["messages"], **kw) if p.get("messages") else gen.generate(p["prompt"], **kw)
            for name, out in outs.items():
                assert out.token_ids == outs["ar"].token_ids, (name, p["id"])
                seconds[p["category"]][name] += out.stats.decode_seconds
    for c in categories:
        print(c, " | ".join(f"{name} {seconds[c]['ar'] / s:.2f}x" for name, s in seconds[c].items()))


if __name__ == "__main__":
    main()
