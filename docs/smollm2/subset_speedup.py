"""Speedups of a bench run over a subset of its prompts (the bench's median of paired ratios).

    python docs/smollm2/subset_speedup.py docs/smollm2/bench-session40.json --exclude chat-code-1,chat-code-2

Session 40 found that two of the eight bench chat prompts have near duplicates in the data
SmolLM2's EAGLE drafter was trained on ("Write a Python function that checks whether a
string is a palindrome." and "...returns the n-th Fibonacci number." are catalogue
instructions, asked in all four shard sets), so their answers are partly memorised; this
prints each row's chat figure without them beside the figure over every prompt.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="a `quickdraft bench --json` file")
    parser.add_argument("--exclude", default="chat-code-1,chat-code-2", help="prompt ids to leave out")
    args = parser.parse_args()
    excluded = set(args.exclude.split(","))
    data = json.load(open(args.json))
    for result in data["results"]:
        plain = next(row for row in result["rows"] if row["label"] == "ar")
        kept = [p for p in plain["runs_by_prompt"] if p not in excluded]
        print(f"{result['category']}: all {len(plain['runs_by_prompt'])} prompts / the {len(kept)} not excluded")
        for row in result["rows"]:
            if not row.get("runs_by_prompt"):
                continue
            figures = [speedup(row, plain, prompts) for prompts in (list(plain["runs_by_prompt"]), kept)]
            print(f"  {row['label']:40} {figures[0]:.2f}x  {figures[1]:.2f}x")


def speedup(row: dict, plain: dict, prompts: list[str]) -> float:
    """As the bench figures it: the median over (prompt, repeat) of tokens/s over plain decoding's."""
    ratios = sorted(run["tokens_per_second"] / base["tokens_per_second"]
                    for prompt in prompts
                    for run, base in zip(row["runs_by_prompt"][prompt], plain["runs_by_prompt"][prompt])
                    if base["tokens_per_second"])
    middle = len(ratios) // 2
    return ratios[middle] if len(ratios) % 2 else (ratios[middle - 1] + ratios[middle]) / 2

if __name__ == "__main__":
    main()
