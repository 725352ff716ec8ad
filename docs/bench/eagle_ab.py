"""A/B in one process: an older commit's EAGLE drafting vs this tree's, greedy chains.

    python docs/bench/eagle_ab.py 04a0ae6 [--model smollm2-135m] [--heads DIR] [--depth 7] [--json OUT]

Exports ``quickdraft/`` of the old commit as the package ``quickdraft_old`` (see
``engine_ab.py``), loads the target and its EAGLE drafter (the shipped one, or ``--heads``)
in each version, and decodes 4 prompts per bench category with a chain of ``--depth``,
twice, alternating the order. Outputs must be token-identical (each is plain decoding's);
the figure is the decode time, new over old, per category.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_ab import export_old  # noqa: E402


def version(package: str, model: str, heads: str | None) -> tuple:
    """(target, drafter factory, decode, stop class, stats class, tokenizer) of ``package``."""
    mods = {name: __import__(f"{package}.{name}", fromlist=["_"]) for name in
            ("pair", "decoding.engine", "decoding.stats", "decoding.stopping", "drafters.eagle", "drafters.shapes")}
    pair = mods["pair"].load_pair(model, need_draft=False)
    head = mods["drafters.eagle"].load_eagle_head(pair.target, heads)

    def drafter(depth: int):
        shape = mods["drafters.shapes"].StaticTree((1,) * depth, sample=False)
        return mods["drafters.eagle"].EagleDrafter(pair.target, head, shape)

    return (pair.target, drafter, mods["decoding.engine"].decode, mods["decoding.stopping"].StopConditions,
            mods["decoding.stats"].GenerationStats, pair.tokenizer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("commit")
    parser.add_argument("--model", default=None, help="target (default: the embedded one)")
    parser.add_argument("--heads", default=None, help="EAGLE drafter (default: the shipped one)")
    parser.add_argument("--categories", default=None, help="comma-separated (default: the model's bench categories)")
    parser.add_argument("--depth", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--json")
    args = parser.parse_args()
    export_old(args.commit, same_kernels=False)
    torch.set_num_threads(2)
    versions = {"old": version("quickdraft_old", args.model, args.heads),
                "new": version("quickdraft", args.model, args.heads)}
    from quickdraft.bench.prompts import builtin_prompts

    tokenizer = versions["new"][5]
    default = "chat,code" if args.model else "short,long,out-of-domain"
    categories = (args.categories or default).split(",")

    def ids(p) -> torch.Tensor:  # a chat through the model's template, as the bench renders it
        text = (tokenizer.apply_chat_template(list(p.messages), add_generation_prompt=True, tokenize=False)
                if p.is_chat else p.prompt)
        tokens = tokenizer(text, add_special_tokens=not p.is_chat)["input_ids"]
        return torch.tensor(tokens[-1900:])

    prompts = {c: [ids(p) for p in builtin_prompts((c,), per_category=4)] for c in categories}
    seconds = {v: dict.fromkeys(categories, 0.0) for v in versions}
    tau = {v: [] for v in versions}
    for repeat in range(2):
        for category, ids_list in prompts.items():
            for i, ids in enumerate(ids_list):
                outputs = {}
                for name in (("old", "new") if (repeat + i) % 2 == 0 else ("new", "old")):
                    target, drafter, decode, stop, stats_class, _ = versions[name]
                    stats = stats_class()
                    steps = decode(target, ids, stop(args.new_tokens, []), drafter=drafter(args.depth),
                                   num_speculative_tokens=args.depth, stats=stats)
                    outputs[name] = [t for step in steps for t in step.tokens]
                    seconds[name][category] += stats.decode_seconds
                    tau[name].append(stats.mean_accepted_tokens)
                if outputs["old"] != outputs["new"]:
                    raise SystemExit(f"outputs differ on {category} prompt {i}")
    print(f"{args.commit} vs this tree: EAGLE chain of {args.depth}, {args.new_tokens} new tokens, greedy, 2 threads, "
          f"4 prompts/category x 2 repeats, alternating order; outputs identical")
    report = {}
    for category in (*categories, "all"):
        old, new = ((sum(seconds[v].values()) if category == "all" else seconds[v][category]) for v in ("old", "new"))
        report[category] = {"old_s": old, "new_s": new, "new_over_old": new / old}
        print(f"{category:14s} old {old:7.2f}s new {new:7.2f}s  new/old time {new / old:.3f}")
    print(f"mean tau: old {sum(tau['old']) / len(tau['old']):.2f}, new {sum(tau['new']) / len(tau['new']):.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"commit": args.commit, "depth": args.depth, "model": args.model,
                                               "results": report}, indent=1) + "\n")


if __name__ == "__main__":
    main()
