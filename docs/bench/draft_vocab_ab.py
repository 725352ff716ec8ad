"""One method at several ``--draft-vocab`` sizes, paired prompt by prompt in one process
(this host's noise moves separate runs by 10-15%):

    python docs/bench/draft_vocab_ab.py --method early-exit --sizes 0,default [--model smollm2-135m]
        [--k 3] [--tree 1,1,1,1,1,1,1,1] [--rounds 2] [--categories short,long,out-of-domain]

For every prompt of each category the generators (one per size; ``default``: the
drafter's own ``draft_vocab.json`` size) generate 128 tokens greedily in turn, the order
alternating between rounds. Prints per category each size's mean tau and its decode time
over the first size's (geometric mean over prompts of per-prompt median times), and
whether every size gave the same tokens (it must: only proposals change).
"""

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from quickdraft.bench.prompts import builtin_prompts  # noqa: E402
from quickdraft.generator import DraftOptions, SpeculativeGenerator  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="the target (default: the embedded one)")
    parser.add_argument("--method", required=True)
    parser.add_argument("--sizes", default="0,default", help="comma-separated --draft-vocab sizes or 'default'")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--tree", default=None, help="the method's --tree (EAGLE: 1,1,... for a chain)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--categories", default=None, help="default: the model's bench categories")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    options = DraftOptions(tree=args.tree) if args.tree else None
    gens = {s: SpeculativeGenerator.from_pretrained(args.model, method=args.method, options=options,
                                                    draft_vocab=None if s == "default" else int(s))
            for s in sizes}
    categories = (args.categories or ("chat,code" if args.model else "short,long,out-of-domain")).split(",")
    prompts = builtin_prompts(tuple(categories))
    for category in categories:
        chosen = [p for p in prompts if p.category == category]
        times = {s: {p.id: [] for p in chosen} for s in sizes}
        tau = {s: [] for s in sizes}
        tokens = {s: {} for s in sizes}
        for r in range(args.rounds):
            for p in chosen:
                for s, g in (gens.items() if r % 2 == 0 else list(gens.items())[::-1]):
                    kw = {"messages": list(p.messages)} if p.is_chat else {"prompt": p.prompt}
                    out = g.generate(**kw, max_new_tokens=args.max_new_tokens, num_speculative_tokens=args.k)
                    times[s][p.id].append(out.stats.decode_seconds)
                    tau[s].append(out.stats.mean_accepted_tokens)
                    tokens[s][p.id] = out.token_ids
        base = sizes[0]
        parts = []
        for s in sizes:
            part = f"{s}: tau {statistics.fmean(tau[s]):.2f}"
            if s != base:
                ratio = math.exp(statistics.fmean(math.log(statistics.median(times[s][i]) / statistics.median(
                    times[base][i])) for i in times[s]))
                part += f", time {ratio:.3f}x"
            parts.append(part)
        same = all(tokens[s] == tokens[base] for s in sizes)
        print(f"{category} ({len(chosen)} prompts): " + " | ".join(parts)
              + ("; the same tokens" if same else "; TOKENS DIFFER"), flush=True)


if __name__ == "__main__":
    main()
