"""Paired A/B of EAGLE drafters beside SmolLM2 on the bench's chat and code prompts.

    PYTHONPATH=. python docs/smollm2/drafter_ab.py OLD_DIR NEW_DIR [--tree 1,1] [--repeats 2]

One process, one loaded target: plain decoding, EAGLE's chain and hybrid-eagle with each
drafter, in alternating order within every (repeat, prompt) so drift in the machine's
speed hits them alike; every output must equal plain decoding's. Prints per category the
speedup over plain decoding (summed decode time), tau (tokens per target pass, the
prefill pass counted) and tokens/s; "chat-clean" leaves out the --exclude prompts. Session 38 compared the drafter before and after its
greedy-data run with it (docs/smollm2/bench.md, "Session 38"); docs/bench/eagle_ab.py
compares two versions of the code instead. Take the CPU lock first (`flock
/tmp/quickdraft-cpu.lock ...`).
"""

from __future__ import annotations

import argparse
import time

from quickdraft.bench.prompts import builtin_prompts
from quickdraft.drafters.eagle import load_eagle_head
from quickdraft.drafters.factory import DraftOptions
from quickdraft.generator import SpeculativeGenerator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heads", nargs="+", help="EAGLE drafter directories for SmolLM2")
    parser.add_argument("--tree", default="1,1", help="the chain both methods draft (default 1,1)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--exclude", default="chat-code-1,chat-code-2",
                        help="prompts also left out of a second chat line (default: the two with near duplicates "
                             "in the drafter's training data, docs/smollm2/datastore.md)")
    args = parser.parse_args()

    plain = SpeculativeGenerator.from_pretrained("smollm2-135m", method="ar")
    target, tokenizer = plain.target, plain.tokenizer
    gens = {"ar": plain}
    for i, path in enumerate(args.heads):
        options = DraftOptions(heads=load_eagle_head(target, path), tree=args.tree)
        gens[f"hybrid-eagle {i}"] = SpeculativeGenerator.for_pair(target, None, tokenizer, "hybrid-eagle", options)
        chain = gens[f"eagle {i}"] = SpeculativeGenerator.for_pair(target, None, tokenizer, "eagle", options)
        chain.num_speculative_tokens = len(args.tree.split(","))
    prompts = builtin_prompts(("chat", "code"))
    excluded = set(args.exclude.split(",")) if args.exclude else set()

    def run(gen, prompt):
        if prompt.category == "chat":
            return gen.generate(messages=[{"role": "user", "content": prompt.prompt}],
                                max_new_tokens=args.max_new_tokens)
        return gen.generate(prompt.prompt, max_new_tokens=args.max_new_tokens)

    for gen in gens.values():  # warm-up
        run(gen, prompts[0])
    totals: dict[tuple[str, str], list[float]] = {}
    for repeat in range(args.repeats):
        for i, prompt in enumerate(prompts):
            order = list(gens) if (repeat + i) % 2 == 0 else list(reversed(gens))
            outputs = {}
            for name in order:
                started = time.perf_counter()
                out = run(gens[name], prompt)
                seconds = time.perf_counter() - started
                outputs[name] = out.token_ids
                groups = [prompt.category] + ([f"{prompt.category}-clean"] if prompt.id not in excluded else [])
                for group in groups:
                    total = totals.setdefault((group, name), [0.0, 0, 0])
                    total[0] += seconds
                    total[1] += len(out.token_ids)
                    total[2] += out.stats.target_forward_passes
            wrong = [name for name, ids in outputs.items() if ids != outputs["ar"]]
            if wrong:
                raise SystemExit(f"{', '.join(wrong)} changed the greedy output of {prompt.id}")
    for category in ("chat", "chat-clean", "code"):
        plain_seconds = totals[(category, "ar")][0]
        for name in gens:
            seconds, tokens, passes = totals[(category, name)]
            print(f"{category:10} {name:16} {plain_seconds / seconds:.3f}x  tau {tokens / passes:.2f}  "
                  f"{tokens / seconds:.0f} tok/s")


if __name__ == "__main__":
    main()
