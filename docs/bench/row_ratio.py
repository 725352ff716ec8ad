"""Two rows of one bench run compared run by run: ``quickdraft bench`` alternates its rows
within every (repeat, prompt), so row A's and row B's runs of the same prompt in the same
repeat ran side by side, and their tokens/s ratio is a paired measure that this host's
drift moves far less than the rows' medians:

    python docs/bench/row_ratio.py RUN.json "eagle k=12,draft_stop=heuristic" "draft k=12,draft_stop=heuristic"

Prints per category (and over all of them): the median of A / B over prompts and repeats,
its geometric mean, and a 95% bootstrap interval of the geometric mean over prompts (each
prompt's repeats stay together). Above 1: A faster. A label that is not in the run lists
the run's labels.
"""

import argparse
import json
import math
import random
import statistics
import sys


def paired_ratios(category: dict, a: str, b: str) -> dict[str, list[float]]:
    """Per prompt id: A's tokens/s over B's, one ratio per repeat."""
    rows = {row["label"]: row for row in category["rows"]}
    runs_a, runs_b = rows[a]["runs_by_prompt"], rows[b]["runs_by_prompt"]
    return {pid: [x["tokens_per_second"] / y["tokens_per_second"] for x, y in zip(runs_a[pid], runs_b[pid])]
            for pid in runs_a if pid in runs_b}


def geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def bootstrap(by_prompt: dict[str, list[float]], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of the geometric mean, prompts drawn with replacement."""
    rng, groups = random.Random(seed), list(by_prompt.values())
    means = sorted(geomean([r for g in rng.choices(groups, k=len(groups)) for r in g]) for _ in range(draws))
    return means[int(0.025 * draws)], means[int(0.975 * draws) - 1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a bench run's JSON (quickdraft bench --json FILE)")
    parser.add_argument("a", help="row label (as the report prints it)")
    parser.add_argument("b", help="row label to compare against")
    args = parser.parse_args()
    results = json.load(open(args.run))["results"]
    labels = {row["label"] for category in results for row in category["rows"]}
    missing = [label for label in (args.a, args.b) if label not in labels]
    if missing:
        print(f"row_ratio: no row {missing[0]!r} in {args.run}; its rows: {', '.join(sorted(labels))}", file=sys.stderr)
        return 2
    print(f"{args.a} / {args.b}, tokens/s run by run ({args.run})")
    pooled: dict[str, list[float]] = {}
    for category in results:
        by_prompt = paired_ratios(category, args.a, args.b)
        pooled.update(by_prompt)
        flat = [r for rs in by_prompt.values() for r in rs]
        low, high = bootstrap(by_prompt)
        print(f"  {category['category']:<14} median {statistics.median(flat):.3f}  geomean {geomean(flat):.3f} "
              f"[{low:.3f}, {high:.3f}]  ({len(by_prompt)} prompts, {len(flat)} runs)")
    flat = [r for rs in pooled.values() for r in rs]
    low, high = bootstrap(pooled)
    print(f"  {'all':<14} median {statistics.median(flat):.3f}  geomean {geomean(flat):.3f} [{low:.3f}, {high:.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
