"""Prophet vs early exit vs Medusa vs EAGLE vs a separate draft: acceptance while training.

    python docs/heads/probe_curves.py run  [--steps 120] [--work runs/probe-curves]
    python docs/heads/probe_curves.py plot [--work runs/probe-curves]

``run`` trains one drafter of each kind for the embedded target with the project's own
trainers (``quickdraft train draft | exit-head | heads``), on the same data (the embedded
corpus' train split), the same windows per step, steps and seed, each at its trainer's
default learning rate. Every ``--probe-every`` steps the trainer decodes the same held-out
prompts greedily with the drafter being trained (``train/probe.py``: 4 prompts, 32 new
tokens, 4 draft tokens a step) and logs the acceptance to TensorBoard (``probe/*``). A run
that stops resumes from its checkpoint when ``run`` is started again.

``plot`` reads those event files back (TensorBoard's reader) and draws
``docs/heads/probe_curves.png``: mean accepted tokens per target pass against training
step, and the acceptance of each draft position at the last probe. It copies the event
files to ``docs/heads/probe_runs/<kind>/`` (``tensorboard --logdir docs/heads/probe_runs``
shows them) and writes the figures it drew to ``probe_curves.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGET = "qd-stdlib-target"
# Each kind's own options; 4 draft tokens a step everywhere (EAGLE: a tree 4 deep).
KINDS: dict[str, list[str]] = {
    "draft model": ["draft"],
    "early exit (layer 1 + block)": ["exit-head", "--exit-layer", "1", "--extra-block"],
    "Medusa (4 heads)": ["heads", "--kind", "medusa", "--num-heads", "4"],
    "prophet": ["heads", "--kind", "prophet", "--gamma", "4"],
    "EAGLE": ["heads", "--kind", "eagle", "--ttt-steps", "4", "--draft-vocab", "2048"],
}


def slug(kind: str) -> str:
    return kind.split(" (")[0].replace(" ", "-").lower()


def run(args: argparse.Namespace) -> None:
    for kind, options in KINDS.items():
        if args.only and slug(kind) not in args.only:
            continue
        out = args.work / slug(kind)
        if (out / "config.json").exists():
            print(f"{kind}: done ({out})")
            continue
        work = args.work / f"{slug(kind)}-work"
        cmd = [sys.executable, "-m", "quickdraft", "train", *options, "--target", TARGET, "--data", "stdlib",
               "--out", str(out), "--work-dir", str(work), "--steps", str(args.steps), "--seq-len", str(args.seq_len),
               "--batch-size", str(args.batch_size), "--probe-every", str(args.probe_every),
               "--ckpt-every", str(args.probe_every), "--log-every", "10", "--eval-tokens", "8192", "--seed", "0",
               "--threads", "2", "--no-progress", "--force", "--resume"]  # --resume: from a checkpoint if any
        print(f"{kind}: {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, check=True)


def plot(args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from quickdraft.train.tracker import TB_DIR, read_scalars

    figures: dict[str, dict] = {}
    for kind in KINDS:
        events = args.work / slug(kind) / TB_DIR
        if not events.exists():
            print(f"{kind}: no event files under {events}; run it first")
            continue
        copy = HERE / "probe_runs" / slug(kind)
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(events, copy)
        scalars = read_scalars(copy)
        curve = scalars["probe/mean_accepted_tokens"]
        positions = sorted((int(t.rsplit("pos", 1)[1]), v[-1][1]) for t, v in scalars.items()
                           if t.startswith("probe/accept_rate/pos"))
        figures[kind] = {"steps": [s for s, _ in curve], "mean_accepted_tokens": [round(v, 4) for _, v in curve],
                         "final_accept_rate_by_position": [round(v, 4) for _, v in positions]}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for kind, f in figures.items():
        left.plot(f["steps"], f["mean_accepted_tokens"], marker="o", markersize=3, label=kind)
        rates = f["final_accept_rate_by_position"]
        right.plot(range(1, len(rates) + 1), rates, marker="o", label=kind)
    left.set_xlabel("training step")
    left.set_ylabel("tokens per target pass (greedy probe)")
    left.set_title("Acceptance while training", fontsize=10)
    right.set_xlabel("draft position")
    right.set_ylabel("accepted when drafted (last probe)")
    right.set_xticks(range(1, 5))
    right.set_ylim(0, 1)
    right.set_title("Acceptance per draft position after training", fontsize=10)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle(f"Drafters for {TARGET}, same data, steps and seed (TensorBoard probe/*)", fontsize=10)
    fig.tight_layout()
    fig.savefig(HERE / "probe_curves.png", dpi=110)
    (HERE / "probe_curves.json").write_text(json.dumps(figures, indent=1) + "\n")
    for kind, f in figures.items():
        rates = " ".join(f"{r:.2f}" for r in f["final_accept_rate_by_position"])
        print(f"{kind:32s} tokens/pass {f['mean_accepted_tokens'][0]:.2f} -> {f['mean_accepted_tokens'][-1]:.2f}"
              f"   per position {rates}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("run", "plot"))
    parser.add_argument("--work", type=Path, default=Path("runs/probe-curves"))
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--probe-every", type=int, default=20)
    parser.add_argument("--only", nargs="+", metavar="KIND", help="run only these kinds: "
                        + ", ".join(slug(k) for k in KINDS))
    args = parser.parse_args()
    run(args) if args.action == "run" else plot(args)


if __name__ == "__main__":
    main()
