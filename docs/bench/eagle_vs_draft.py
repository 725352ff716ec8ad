"""EAGLE's chain against the separate draft model, paired prompt by prompt in one process
(the bench's rows are medians of ratios that this host's noise moves by 10-15%):

    python docs/bench/eagle_vs_draft.py [--k 8] [--rounds 2] [--categories short,long,out-of-domain]
        [--heads DIR ...] [--dtype bfloat16] [--draft-stop heuristic]

For every prompt of each category, plain decoding, the draft model at k and an EAGLE chain
of k (the shipped drafter, and each ``--heads`` drafter) generate 128 tokens in turn (the
order alternating between rounds). Prints per category: each method's speedup over plain
decoding (geometric mean over prompts of the per-prompt ratio of median decode times),
tau, and each EAGLE drafter's decode time over the draft's with a 95% bootstrap interval
over prompts (below 1: EAGLE faster). ``--draft-stop heuristic`` gives the draft model and
every EAGLE chain lengths that follow acceptance, up to ``--k``.
"""

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from quickdraft.generator import DraftOptions, SpeculativeGenerator  # noqa: E402


def geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def generators(k: int, heads: list[str], dtype: str = "auto",
               draft_stop: str = "fixed") -> dict[str, SpeculativeGenerator]:
    """The draft model, the shipped EAGLE drafter and each of ``heads`` as chains of ``k``."""
    chain = ",".join(["1"] * k)

    def load(method: str, **options) -> SpeculativeGenerator:
        return SpeculativeGenerator.from_pretrained(method=method, dtype=dtype,
                                                    options=DraftOptions(draft_stop=draft_stop, **options))

    gens = {"draft": load("draft"), "eagle": load("eagle", tree=chain)}
    for path in heads:
        gens[f"eagle:{Path(path).name}"] = load("eagle", tree=chain, heads=path)
    return gens


def bench_prompts(category: str) -> list[dict]:
    return [json.loads(line) for line in open(ROOT / "quickdraft" / "assets" / "bench" / f"{category}.jsonl")]


def paired_runs(gens: dict, prompts: list[dict], rounds: int, max_new_tokens: int,
                k: int) -> tuple[dict, dict]:
    """Each generator on each prompt in turn, ``rounds`` times (the order reversed every
    other round): the median decode seconds per generator and prompt id, and every run's tau."""
    times = {key: {p["id"]: [] for p in prompts} for key in gens}
    tau = {key: [] for key in gens}
    for r in range(rounds):
        for p in prompts:
            for key, g in (gens.items() if r % 2 == 0 else list(gens.items())[::-1]):
                out = g.generate(p["prompt"], max_new_tokens=max_new_tokens, num_speculative_tokens=k)
                times[key][p["id"]].append(out.stats.decode_seconds)
                tau[key].append(out.stats.mean_accepted_tokens)
    return {key: {i: statistics.median(t) for i, t in by_id.items()} for key, by_id in times.items()}, tau


def paired_parser(doc: str) -> argparse.ArgumentParser:
    """The options every paired script here takes."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--categories", default="short,long,out-of-domain")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-stop", default="fixed", help="fixed (default) or heuristic: chains up to --k")
    return parser


def main() -> None:
    parser = paired_parser(__doc__)
    parser.add_argument("--heads", nargs="*", default=[], help="more EAGLE drafter directories")
    parser.add_argument("--dtype", default="auto", help="every model's --dtype (default: float32 on the CPU)")
    args = parser.parse_args()
    gens = {"ar": SpeculativeGenerator.from_pretrained(method="ar", dtype=args.dtype),
            **generators(args.k, args.heads, args.dtype, args.draft_stop)}
    eagles = [m for m in gens if m.startswith("eagle")]
    rng = random.Random(0)
    for category in args.categories.split(","):
        prompts = bench_prompts(category)
        med, tau = paired_runs(gens, prompts, args.rounds, args.max_new_tokens, args.k)
        ids = [p["id"] for p in prompts]
        speed = {m: geomean([med["ar"][i] / med[m][i] for i in ids]) for m in gens if m != "ar"}
        print(f"{category} ({len(ids)} prompts): draft k={args.k} {speed['draft']:.2f}x (tau "
              f"{statistics.fmean(tau['draft']):.2f})", flush=True)
        for m in eagles:
            ratios = [med[m][i] / med["draft"][i] for i in ids]
            boots = sorted(geomean([rng.choice(ratios) for _ in ratios]) for _ in range(2000))
            print(f"  {m} chain of {args.k} {speed[m]:.2f}x (tau {statistics.fmean(tau[m]):.2f}); / draft decode "
                  f"time {geomean(ratios):.3f} [{boots[50]:.3f}, {boots[1949]:.3f}]", flush=True)


if __name__ == "__main__":
    main()
