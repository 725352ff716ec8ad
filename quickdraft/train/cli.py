"""``quickdraft train``: reproduce the embedded model family (tokenizer, target, draft).

Wire it into a parent parser with :func:`add_train_parser`; or run standalone with
``python -m quickdraft.train.cli --out DIR``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from .presets import PRESETS

ASSETS_MODELS = Path(__file__).resolve().parent.parent / "assets" / "models"


def _configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--out", type=Path, default=ASSETS_MODELS,
                   help="where the model directories go (default: the package's embedded "
                        "models dir, %(default)s)")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="checkpoints, token caches and logs (default: runs/train when --out is "
                        "the package assets dir, else OUT/_work)")
    p.add_argument("--stage", choices=["all", "tokenizer", "target", "draft", "timing", "breakdown", "cards"],
                   default="all",
                   help="run one stage (each needs the previous ones) or all; 'timing' re-measures "
                        "decode cost, 'breakdown' scores code-only validation, 'cards' rewrites the model cards from WORK/results.json")
    p.add_argument("--preset", choices=sorted(PRESETS), default="default",
                   help="model sizes and step budgets (tiny: smoke test in seconds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-steps", type=int, default=None, help="override the preset")
    p.add_argument("--draft-steps", type=int, default=None, help="override the preset")
    p.add_argument("--max-files", type=int, default=None,
                   help="use only the first N corpus files (sorted by path)")
    p.add_argument("--corpus-root", type=Path, default=None,
                   help="directory of .py files to train on (default: the stdlib)")
    p.add_argument("--include-tests", action="store_true",
                   help="also train on the stdlib test suites (excluded by default)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint of the stage(s) being run")
    p.add_argument("--threads", default="2",
                   help="torch CPU threads (default 2); 'auto' picks 1 or 2 per step by measured "
                        "step time, which avoids 2-thread slowdowns when the CPU is shared")
    p.add_argument("--init-target", type=Path, default=None,
                   help="continue training this target checkpoint (and keep its tokenizer) "
                        "instead of training one from scratch")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    return p


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``train`` sub-command to an argparse ``subparsers`` object."""
    p = subparsers.add_parser(
        "train", help="train the embedded model family (tokenizer, target, draft)",
        description=__doc__.splitlines()[0])
    _configure(p)
    p.set_defaults(func=run_train)
    return p


def default_work_dir(out: Path) -> Path:
    if Path(out).resolve() == ASSETS_MODELS.resolve():
        return Path("runs") / "train"
    return Path(out) / "_work"


def run_train(args) -> int:
    import torch

    from .pipeline import STAGES, Pipeline
    from .presets import get_preset

    threads = args.threads if args.threads == "auto" else int(args.threads)
    torch.set_num_threads(2 if threads == "auto" else threads)
    preset = get_preset(args.preset, target_steps=args.target_steps,
                        draft_steps=args.draft_steps)
    work = args.work_dir or default_work_dir(args.out)
    argv = getattr(args, "_argv", None) or sys.argv[1:]
    if argv and argv[0] == "train":
        argv = argv[1:]
    command = "quickdraft train " + shlex.join(argv)
    pipe = Pipeline(args.out, work, preset, seed=args.seed, corpus_root=args.corpus_root,
                    max_files=args.max_files, include_tests=args.include_tests,
                    resume=args.resume, command=command.strip(),
                    progress=not args.no_progress,
                    log=lambda m: print(m, file=sys.stderr, flush=True), threads=threads,
                    init_target=args.init_target)
    stages = STAGES if args.stage == "all" else (args.stage,)
    pipe.run(stages)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="quickdraft")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "train":
        argv = ["train", *argv]
    args = parser.parse_args(argv)
    args._argv = argv
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
