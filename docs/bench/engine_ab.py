"""A/B in one process: an older commit's engine vs this tree's, plain and draft-model decoding.

    python docs/bench/engine_ab.py fe77ec1 [--same-kernels] [-k 7] [--json OUT]

Exports ``quickdraft/`` of the old commit (``git archive``) as the package
``quickdraft_old`` and times both versions on the embedded pair over 6 prompts per bench
category, twice, alternating the order. Outputs must be token-identical. With
``--same-kernels`` the old copy gets this tree's decode linears, so only the engine code
differs (the trees issue's "the generalised engine must not slow plain or chain
speculative decoding" check); without it, the whole runtime is compared.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
CATEGORIES = ("short", "long", "out-of-domain")


def export_old(commit: str, same_kernels: bool) -> Path:
    """``quickdraft/`` of ``commit`` as ``<tmp>/quickdraft_old`` (without the model weights)."""
    tmp = Path(tempfile.mkdtemp(prefix="qd-ab-"))
    blob = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "quickdraft"], check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(tmp, filter="data")
    old = tmp / "quickdraft_old"
    (tmp / "quickdraft").rename(old)
    if same_kernels:
        lm = old / "models" / "lm.py"
        source = lm.read_text()
        source = source.replace("from .decode_linear import prepack_decode_linears, use_decode_linears",
                                "from .decode_linear import use_decode_linears")
        source = source.replace("prepack_decode_linears(self.model, step_tokens)", "pass")
        lm.write_text(source)
        (old / "models" / "decode_linear.py").write_text((ROOT / "quickdraft/models/decode_linear.py").read_text())
    sys.path.insert(0, str(tmp))
    return tmp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("commit")
    parser.add_argument("--same-kernels", action="store_true")
    parser.add_argument("-k", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--json")
    args = parser.parse_args()
    export_old(args.commit, args.same_kernels)
    torch.set_num_threads(2)

    from quickdraft_old.drafters.draft_model import DraftModelDrafter as OldDrafter
    from quickdraft_old.engine import decode as old_decode
    from quickdraft_old.models.lm import load_model as old_load
    from quickdraft_old.stats import GenerationStats as OldStats
    from quickdraft_old.stopping import StopConditions as OldStop

    from quickdraft.decoding.engine import decode
    from quickdraft.decoding.stats import GenerationStats
    from quickdraft.decoding.stopping import StopConditions
    from quickdraft.drafters import DraftModelDrafter
    from quickdraft.models.lm import load_model
    from quickdraft.models.loading import resolve_model_dir
    from quickdraft.pair import load_tokenizer

    target_dir, draft_dir = resolve_model_dir("qd-stdlib-target"), resolve_model_dir("qd-stdlib-draft")
    tokenizer = load_tokenizer(target_dir)
    versions = {
        "old": (old_load(target_dir), old_load(draft_dir), OldDrafter, old_decode, OldStop, OldStats),
        "new": (load_model(target_dir), load_model(draft_dir), DraftModelDrafter, decode, StopConditions,
                GenerationStats),
    }
    prompts = {}
    for category in CATEGORIES:
        lines = (ROOT / f"quickdraft/assets/bench/{category}.jsonl").read_text().splitlines()
        texts = [json.loads(line)["prompt"] for line in lines if line.strip()][:6]
        prompts[category] = [torch.tensor(tokenizer(t)["input_ids"][-1900:]) for t in texts]

    def run(version: str, method: str, ids: torch.Tensor) -> tuple[list[int], float]:
        target, draft, drafter_class, run_decode, stop_class, stats_class = versions[version]
        stats = stats_class()
        drafter = drafter_class(draft, target.vocab_size) if method == "draft" else None
        steps = run_decode(target, ids, stop_class(args.new_tokens, []), drafter=drafter,
                           num_speculative_tokens=args.k, stats=stats)
        return [t for step in steps for t in step.tokens], stats.decode_seconds

    configs = [(v, m) for m in ("ar", "draft") for v in ("old", "new")]
    seconds = {c: {cat: 0.0 for cat in CATEGORIES} for c in configs}
    for repeat in range(2):
        for category, ids_list in prompts.items():
            for i, ids in enumerate(ids_list):
                outputs = {}
                for config in configs if (repeat + i) % 2 == 0 else configs[::-1]:
                    outputs[config], secs = run(*config, ids)
                    seconds[config][category] += secs
                if len({tuple(o) for o in outputs.values()}) != 1:
                    raise SystemExit(f"outputs differ on {category} prompt {i}")
    kernels = "same decode linears" if args.same_kernels else "each version's own runtime"
    print(f"{args.commit} vs this tree ({kernels}); k={args.k}, {args.new_tokens} new tokens, greedy, 2 threads, "
          "6 prompts/category x 2 repeats, alternating order; outputs identical")
    report = {}
    for method in ("ar", "draft"):
        for category in (*CATEGORIES, "all"):
            old = sum(seconds[("old", method)].values()) if category == "all" else seconds[("old", method)][category]
            new = sum(seconds[("new", method)].values()) if category == "all" else seconds[("new", method)][category]
            report[f"{method}/{category}"] = {"old_s": old, "new_s": new, "new_over_old": new / old}
            print(f"{method:6s} {category:14s} old {old:7.2f}s new {new:7.2f}s  new/old time {new / old:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"commit": args.commit, "same_kernels": args.same_kernels,
                                               "k": args.k, "results": report}, indent=1))


if __name__ == "__main__":
    main()
