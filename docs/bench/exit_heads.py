"""Which exit head (layer, kind) the cost model picks for a target, among trained heads.

    python docs/bench/exit_heads.py HEAD_DIR [HEAD_DIR ...] [--target NAME] [--json OUT]

For each head (``shared:L`` for the untrained shared head at layer L),
``bench/exit_layer.measure_exit_layer`` times the draft step and the verify passes from
layer L (shared KV cache) on this machine and measures greedy per-position acceptance on
the auto-k calibration prompts; the cost model predicts the speedup at every k. Prints a
row per head and the best (head, k).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from quickdraft.drafters.early_exit import SHARED, resolve_exit_head
from quickdraft.models.lm import load_model
from quickdraft.pair import load_tokenizer
from quickdraft.policy.exit_layer import measure_exit_layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heads", nargs="+", help="exit head directories, or shared:L")
    parser.add_argument("--target", default="qd-stdlib-target")
    parser.add_argument("--max-k", type=int, default=6)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    target = load_model(args.target, backend="native")
    tokenizer = load_tokenizer(target.model_dir)
    rows = []
    for spec in args.heads:
        if spec.startswith(f"{SHARED}:"):
            head = resolve_exit_head(target, SHARED, int(spec.split(":")[1]))
        else:
            head = resolve_exit_head(target, spec, None)
        choice = measure_exit_layer(target, tokenizer, {head.exit_layer: head}, max_k=args.max_k, repeats=5)
        info = choice.per_layer[choice.layer]
        rows.append({"head": spec, "layer": head.exit_layer, "kind": head.kind, "k": choice.k,
                     "predicted_speedup": choice.predicted_speedup, "draft_cost_ratio": info["draft_cost_ratio"],
                     "acceptance_by_position": info["per_position"][: args.max_k]})
        accept = " ".join(f"{a:.2f}" for a in info["per_position"][:4])
        print(f"{spec:50s} L={head.exit_layer} {head.kind:8s} draft/target {info['draft_cost_ratio']:.2f} "
              f"acceptance {accept}  best k={choice.k} predicted {choice.predicted_speedup:.2f}x", flush=True)
    best = max(rows, key=lambda r: r["predicted_speedup"])
    print(f"best: {best['head']} at k={best['k']} (predicted {best['predicted_speedup']:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"target": args.target, "rows": rows, "best": best}, indent=1) + "\n")


if __name__ == "__main__":
    main()
