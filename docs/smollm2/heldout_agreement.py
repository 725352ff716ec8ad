"""Held-out agreement of SmolLM2 EAGLE drafters, on the same windows, at every place and
on the target's answers alone.

    PYTHONPATH=. python docs/smollm2/heldout_agreement.py DIR [DIR ...] [--tokens 32768]

The held-out documents of the shipped self-distillation sets (held out by prompt, so no
trained prompt is among them; `train/textdata.py`), scored teacher-forced as `train heads`
scores them: top-1 agreement of each unrolled step with the target's greedy token, over
every place, then over the places `--loss-on answers` counts (the token predicted and the
drafts before it are the target's answer, not its prompt), against the target as generation
runs it (`--teacher auto`, train heads' default). Take the CPU lock first.
"""

from __future__ import annotations

import argparse
import json

import torch

from quickdraft.models.eagle import load_eagle
from quickdraft.train.distill import tokenize
from quickdraft.train.eagle import eagle_agreement
from quickdraft.train.exit_head import load_native_teacher, load_teacher_passes
from quickdraft.train.heads import TargetStates
from quickdraft.train.textdata import read_text_data

SETS = ("smollm2-135m-gpu-1", "smollm2-135m-gpu-2", "smollm2-135m", "smollm2-135m-s1", "smollm2-135m-greedy2",
        "smollm2-135m-greedy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heads", nargs="+", help="EAGLE drafter directories for SmolLM2")
    parser.add_argument("--tokens", type=int, default=32768, help="held-out tokens scored (default 32768)")
    parser.add_argument("--steps", type=int, default=3, help="unrolled steps (default 3)")
    parser.add_argument("--data", nargs="+", default=[f"data/selfdistill/{name}" for name in SETS],
                        help="self-distillation sets whose held-out documents are scored (default: the shipped six)")
    args = parser.parse_args()
    target, target_dir, tok = load_native_teacher("smollm2-135m")
    passes, _ = load_teacher_passes(target, target_dir)  # the target as generation runs it (train heads' default)
    tokens = tokenize(read_text_data(args.data), tok, 512)
    share = float(tokens.heldout_answers[: args.tokens].mean())
    print(f"held-out: {tokens.heldout.size:,} tokens, {args.tokens:,} scored, {share:.1%} of them answers")
    for path in args.heads:
        head = load_eagle(path, target).float()
        states = TargetStates(target, head.feature_layers, passes)
        with torch.no_grad():
            every = eagle_agreement(head, states, tokens.heldout, 512, args.tokens, args.steps)
            answers = eagle_agreement(head, states, tokens.heldout, 512, args.tokens, args.steps,
                                      tokens.heldout_answers)
        print(json.dumps({"heads": path, "every_place": [round(a, 4) for a in every],
                          "answers": [round(a, 4) for a in answers]}))


if __name__ == "__main__":
    main()
