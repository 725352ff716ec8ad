"""Acceptance of the draft model and EAGLE drafters with and without the first pass:

    python docs/bench/eagle_first_round.py [--k 8] [--heads DIR ...]

An EAGLE drafter needs the target's features of the prompt, which the prefill pass makes,
so its first pass yields one token; a draft model proposes before the prefill, and the
prefill pass verifies its proposal. Over a short generation that one pass shows in tau
(new tokens / target passes). For every prompt of each category this prints each method's
tau and its decode-pass tau (the tokens of passes after the prefill over those passes), a
chain of k, greedy, 128 tokens. Deterministic: no timing.
"""

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from eagle_vs_draft import bench_prompts, generators  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--categories", default="short,long,out-of-domain")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--heads", nargs="*", default=[], help="more EAGLE drafter directories")
    args = parser.parse_args()
    gens = generators(args.k, args.heads)
    for category in args.categories.split(","):
        prompts = bench_prompts(category)
        cells = []
        for name, gen in gens.items():
            stats = [gen.generate(p["prompt"], max_new_tokens=args.max_new_tokens, num_speculative_tokens=args.k).stats
                     for p in prompts]
            tau = statistics.fmean(s.mean_accepted_tokens for s in stats)
            decode_tau = statistics.fmean(s.decode_tokens / s.decode_passes for s in stats if s.decode_passes)
            first = statistics.fmean(s.prefill_tokens for s in stats)
            cells.append(f"{name} tau {tau:.2f}, decode passes {decode_tau:.2f}, first pass {first:.1f} tokens")
        print(f"{category} ({len(prompts)} prompts): " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
