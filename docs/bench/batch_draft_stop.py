"""Batched rows with ``--draft-stop heuristic`` against a fixed k, paired in one process:

    python docs/bench/batch_draft_stop.py [--dtype bfloat16] [--k 8] [--batch-size 4] [--rounds 2]

For each bench category, plain decoding, the draft model at a fixed k and the draft model
with each row's own heuristic schedule (up to k) generate 128 tokens for every prompt of
the category through ``generate([...])`` (continuous batching, ``--batch-size`` rows at a
time), in turn, the order reversed every other round. Prints each one's speedup over
batched plain decoding (median wall seconds of the whole list, prefill included) and the
draft tokens per verify pass; asserts the three outputs are identical.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eagle_vs_draft import bench_prompts  # noqa: E402

from quickdraft.generator import DraftOptions, SpeculativeGenerator  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    gens = {stop: SpeculativeGenerator.from_pretrained(method="draft", dtype=args.dtype,
                                                       options=DraftOptions(draft_stop=stop))
            for stop in ("fixed", "heuristic")}
    gens["ar"] = SpeculativeGenerator.from_pretrained(method="ar", dtype=args.dtype)
    for category in ("short", "long", "out-of-domain"):
        prompts = [p["prompt"] for p in bench_prompts(category)]
        seconds = {name: [] for name in gens}
        outputs, per_pass = {}, {}
        for r in range(args.rounds):
            for name, gen in (gens.items() if r % 2 == 0 else list(gens.items())[::-1]):
                start = time.perf_counter()
                outs = gen.generate(prompts, max_new_tokens=128, batch_size=args.batch_size,
                                    num_speculative_tokens=None if name == "ar" else args.k)
                seconds[name].append(time.perf_counter() - start)
                outputs[name] = [o.token_ids for o in outs]
                per_pass[name] = (sum(o.stats.drafted_tokens for o in outs)
                                  / sum(o.stats.target_forward_passes for o in outs))
        assert outputs["fixed"] == outputs["heuristic"] == outputs["ar"], category
        plain = statistics.median(seconds["ar"])
        print(f"{category} ({len(prompts)} prompts, {args.batch_size} rows): " + " | ".join(
            f"{name} {plain / statistics.median(seconds[name]):.2f}x ({per_pass[name]:.2f} drafted a pass)"
            for name in ("fixed", "heuristic")), flush=True)


if __name__ == "__main__":
    main()
