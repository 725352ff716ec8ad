"""float32 against bfloat16 (``--dtype bfloat16``: our bfloat16 products on an AVX512_BF16
CPU, docs/quantization.md), paired prompt by prompt in one process (this host's speed
drifts between processes):

    python docs/bench/dtype_ab.py [--k 8] [--rounds 2] [--categories short,long,out-of-domain]
        [--draft-stop heuristic]

For every bench prompt, plain decoding, the draft model at k and an EAGLE chain of k, each
in both dtypes, generate 128 tokens in turn (the order alternating between rounds). Prints
per category and dtype each method's speedup over plain decoding of that dtype (geometric
mean over prompts of the per-prompt ratio of median decode times) with tau, then each
method's bfloat16 tokens/s over its float32 tokens/s.
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eagle_vs_draft import bench_prompts, generators, geomean  # noqa: E402

from quickdraft.generator import SpeculativeGenerator  # noqa: E402

DTYPES = ("float32", "bfloat16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--categories", default="short,long,out-of-domain")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-stop", default="fixed", help="fixed (default) or heuristic: chains up to --k")
    args = parser.parse_args()
    gens: dict[tuple[str, str], SpeculativeGenerator] = {}
    for dtype in DTYPES:
        gens["ar", dtype] = SpeculativeGenerator.from_pretrained(method="ar", dtype=dtype)
        for method, gen in generators(args.k, [], dtype, args.draft_stop).items():
            gens[method, dtype] = gen
    methods = list(dict.fromkeys(m for m, _ in gens))
    for category in args.categories.split(","):
        prompts = bench_prompts(category)
        times = {key: {p["id"]: [] for p in prompts} for key in gens}
        tau = {key: [] for key in gens}
        for r in range(args.rounds):
            for p in prompts:
                for key, g in (gens.items() if r % 2 == 0 else list(gens.items())[::-1]):
                    out = g.generate(p["prompt"], max_new_tokens=args.max_new_tokens, num_speculative_tokens=args.k)
                    times[key][p["id"]].append(out.stats.decode_seconds)
                    tau[key].append(out.stats.mean_accepted_tokens)
        ids = [p["id"] for p in prompts]
        med = {key: {i: statistics.median(times[key][i]) for i in ids} for key in gens}
        print(f"{category} ({len(ids)} prompts)", flush=True)
        for dtype in DTYPES:
            rows = [f"{m} {geomean([med['ar', dtype][i] / med[m, dtype][i] for i in ids]):.2f}x "
                    f"(tau {statistics.fmean(tau[m, dtype]):.2f})" for m in methods if m != "ar"]
            print(f"  {dtype}: " + ", ".join(rows), flush=True)
        ratios = [f"{m} {geomean([med[m, 'float32'][i] / med[m, 'bfloat16'][i] for i in ids]):.2f}x" for m in methods]
        print("  bfloat16 tokens/s over float32's: " + ", ".join(ratios), flush=True)


if __name__ == "__main__":
    main()
