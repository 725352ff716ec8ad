"""How well a draft follows the target's own greedy continuations of the bench prompts.

    python docs/bench/draft_tau.py [DRAFT_DIR] [--prompts 10] [--new-tokens 96] [-k 8]

For each category the target continues the first ``--prompts`` bench prompts greedily;
the draft then reads prompt + continuation in one pass (teacher-forced, whole vocabulary)
and this simulates the draft chain at k: tau = tokens per target pass (accepted run + 1),
exactly what greedy speculative decoding would get, without timing anything. It also
splits the draft's agreement by whether a 2-gram prompt lookup predicts the token
(copying from the context, which a 1-layer draft does less well than the target).
Deterministic: no wall clock, so two drafts compare exactly on a noisy machine.
"""

from __future__ import annotations

import argparse

import torch

from quickdraft.bench.prompts import builtin_prompts
from quickdraft.pair import load_pair


def simulated_tau(agree: list[bool], k: int) -> float:
    """Tokens per target pass of a draft chain at ``k`` given per-token agreement."""
    pos = steps = tokens = 0
    while pos < len(agree):
        run = 0
        while run < k and pos + run < len(agree) and agree[pos + run]:
            run += 1
        steps += 1
        tokens += run + 1
        pos += run + 1
    return tokens / steps


def lookup_predicts(seq: list[int], t: int) -> bool:
    """Whether the most recent earlier occurrence of the 2 tokens before ``t`` was followed by ``seq[t]``."""
    for j in range(t - 2, 1, -1):
        if seq[j - 2] == seq[t - 2] and seq[j - 1] == seq[t - 1]:
            return seq[j] == seq[t]
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("draft", nargs="?", default=None, help="draft directory (default: the embedded draft)")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("-k", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(2)
    pair = load_pair(draft=args.draft, draft_vocab=0)
    tok, target, draft = pair.tokenizer, pair.target, pair.draft
    for category in ("short", "long", "out-of-domain"):
        taus, agree_by_kind = [], {True: [0, 0], False: [0, 0]}
        for p in builtin_prompts((category,))[: args.prompts]:
            ids = tok(p.prompt)["input_ids"]
            target.reset()
            logits = target.extend(torch.tensor(ids), logits="last")
            new = []
            for _ in range(args.new_tokens):
                new.append(int(logits[-1].argmax()))
                logits = target.extend(torch.tensor(new[-1:]), logits="last")
            seq = ids + new
            draft.reset()
            guesses = draft.extend(torch.tensor(seq[:-1])).argmax(-1).tolist()
            agree = [guesses[t - 1] == seq[t] for t in range(len(ids), len(seq))]
            taus.append(simulated_tau(agree, args.k))
            for t, ok in zip(range(len(ids), len(seq)), agree):
                counts = agree_by_kind[lookup_predicts(seq, t)]
                counts[0] += ok
                counts[1] += 1
        copy, other = agree_by_kind[True], agree_by_kind[False]
        print(f"{category}: simulated tau at k={args.k} {sum(taus) / len(taus):.2f} "
              f"(per prompt {', '.join(f'{t:.1f}' for t in taus)}); agreement where a 2-gram lookup "
              f"predicts the token {copy[0] / max(copy[1], 1):.3f} ({copy[1]} tokens), "
              f"elsewhere {other[0] / max(other[1], 1):.3f} ({other[1]} tokens)")


if __name__ == "__main__":
    main()
