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

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eagle_vs_draft import bench_prompts, generators, geomean, paired_parser, paired_runs  # noqa: E402

from quickdraft.generator import SpeculativeGenerator  # noqa: E402

DTYPES = ("float32", "bfloat16")


def main() -> None:
    args = paired_parser(__doc__).parse_args()
    gens: dict[tuple[str, str], SpeculativeGenerator] = {}
    for dtype in DTYPES:
        gens["ar", dtype] = SpeculativeGenerator.from_pretrained(method="ar", dtype=dtype)
        for method, gen in generators(args.k, [], dtype, args.draft_stop).items():
            gens[method, dtype] = gen
    methods = list(dict.fromkeys(m for m, _ in gens))
    for category in args.categories.split(","):
        prompts = bench_prompts(category)
        med, tau = paired_runs(gens, prompts, args.rounds, args.max_new_tokens, args.k)
        ids = [p["id"] for p in prompts]
        print(f"{category} ({len(ids)} prompts)", flush=True)
        for dtype in DTYPES:
            rows = [f"{m} {geomean([med['ar', dtype][i] / med[m, dtype][i] for i in ids]):.2f}x "
                    f"(tau {statistics.fmean(tau[m, dtype]):.2f})" for m in methods if m != "ar"]
            print(f"  {dtype}: " + ", ".join(rows), flush=True)
        ratios = [f"{m} {geomean([med[m, 'float32'][i] / med[m, 'bfloat16'][i] for i in ids]):.2f}x" for m in methods]
        print("  bfloat16 tokens/s over float32's: " + ", ".join(ratios), flush=True)


if __name__ == "__main__":
    main()
