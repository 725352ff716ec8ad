"""Self-speculation on SmolLM2-135M-Instruct against plain decoding, in one process:
early exit with the shipped head (shared KV, k=1..3; its draft_vocab.json's default
vocabulary, others with --draft-vocab) and layer skip with the shipped profile, greedy, on the first chat and the first code prompt of the bench (chat through
the model's template, stopping at its end-of-turn). Rows alternate per prompt and repeat;
tokens/s is the median over prompts x repeats. Run:
``PYTHONPATH=. python docs/smollm2/self_spec.py [--tokens 64] [--repeats 2] [--json OUT]``."""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from quickdraft.bench.prompts import builtin_prompts
from quickdraft.chat import chat_prompt_ids, end_of_turn_ids
from quickdraft.decoding.engine import decode
from quickdraft.decoding.stats import GenerationStats
from quickdraft.decoding.stopping import StopConditions
from quickdraft.drafters import DraftModelDrafter, NoDrafter
from quickdraft.drafters.early_exit import EarlyExitDrafter, resolve_exit_head
from quickdraft.drafters.layer_skip import LayerSkipLM, load_profile
from quickdraft.pair import load_pair


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--head", action="append", default=[], metavar="DIR",
                    help="another exit head to time beside the shipped one (rows 'early-exit DIR k=...')")
    ap.add_argument("--k", default="1,2,3", help="draft lengths of the early-exit rows")
    ap.add_argument("--draft-vocab", action="append", type=int, default=[], metavar="N",
                    help="the shipped head again, its draft steps scoring its N most frequent tokens "
                    "(rows 'early-exit vN k=...'; 0: the whole vocabulary)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    pair = load_pair("smollm2-135m", need_draft=False)
    target, tok = pair.target, pair.tokenizer
    eos = list(dict.fromkeys([*target.eos_token_ids, *end_of_turn_ids(tok)]))
    prompts = {p.category: p for p in reversed(builtin_prompts(("chat", "code")))}
    ids = {c: torch.tensor(chat_prompt_ids(tok, p.messages) if p.is_chat else tok(p.prompt)["input_ids"])
           for c, p in prompts.items()}
    heads = {"": resolve_exit_head(target, None, None)}
    heads.update({f" {d}": resolve_exit_head(target, d, None) for d in args.head})
    heads.update({f" v{n}": resolve_exit_head(target, None, None, n) for n in args.draft_vocab})
    profile = load_profile(target)
    rows = {"ar": (lambda: NoDrafter(), 1)}
    for label, head in heads.items():
        for k in map(int, args.k.split(",")):
            rows[f"early-exit{label} L={head.exit_layer} k={k}"] = (
                lambda head=head: EarlyExitDrafter(target, head, share_kv=True), k)
    rows[f"layer-skip k={profile.k}"] = (lambda: DraftModelDrafter(LayerSkipLM(target, profile), target.vocab_size),
                                         profile.k)
    drafters = {name: make() for name, (make, _) in rows.items()}
    results: dict = {name: {c: [] for c in ids} for name in rows}
    for name in rows:  # warm-up
        list(decode(target, ids["code"], StopConditions(8, eos), drafter=drafters[name],
                    num_speculative_tokens=rows[name][1]))
    for rep in range(args.repeats):
        for c, prompt in ids.items():
            order = list(rows)[rep % len(rows):] + list(rows)[:rep % len(rows)]
            for name in order:
                stats, out = GenerationStats(), []
                for step in decode(target, prompt, StopConditions(args.tokens, eos), drafter=drafters[name],
                                   num_speculative_tokens=rows[name][1], stats=stats):
                    out.extend(step.tokens)
                results[name][c].append({"tokens": out, "tok_s": len(out) / stats.decode_seconds,
                                         "tau": stats.mean_accepted_tokens})
    report = {}
    for name in rows:
        report[name] = {}
        for c in ids:
            runs = results[name][c]
            ref = results["ar"][c]
            report[name][c] = {
                "tok_s": statistics.median(r["tok_s"] for r in runs),
                "speedup": statistics.median(r["tok_s"] / a["tok_s"] for r, a in zip(runs, ref)),
                "tau": statistics.median(r["tau"] for r in runs),
                "lossless": all(r["tokens"] == a["tokens"] for r, a in zip(runs, ref)),
                "tokens": len(runs[0]["tokens"]),
            }
            print(f"{c:5s} {name:24s} {report[name][c]['tok_s']:6.1f} tok/s  {report[name][c]['speedup']:.2f}x  "
                  f"tau {report[name][c]['tau']:.2f}  lossless {report[name][c]['lossless']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"prompts": {c: p.id for c, p in prompts.items()}, "tokens": args.tokens,
                       "repeats": args.repeats, "rows": report}, f, indent=1)


if __name__ == "__main__":
    main()
