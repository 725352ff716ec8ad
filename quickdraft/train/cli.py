"""``quickdraft train``: reproduce the embedded model family (tokenizer, target, draft),
and ``quickdraft train draft``: distil a draft for any target.

Training never writes into the installed package unless told to: ``--out`` is required,
and a directory inside the package needs ``--force`` (``quickdraft train --force`` alone
rebuilds the embedded family in place).

Wire it into a parent parser with :func:`add_train_parser`; or run standalone with
``python -m quickdraft.train.cli --out DIR``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from ..argtypes import non_negative_float, non_negative_int, positive_float, positive_int
from ..jsonl import check_writable
from ..models.registry import ASSETS_DIR, PACKAGE_DIR
from .presets import PRESETS
from .textdata import TrainInputError


def _configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--out", type=Path, default=None,
                   help="where the model directories go (required: training never writes into "
                        "the package unless you pass --force)")
    p.add_argument("--force", action="store_true",
                   help="allow writing into the installed package; without --out: overwrite the "
                        f"embedded family in {ASSETS_DIR}")
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
    p.add_argument("--target-steps", type=positive_int, default=None, help="override the preset")
    p.add_argument("--draft-steps", type=positive_int, default=None, help="override the preset")
    p.add_argument("--max-files", type=positive_int, default=None,
                   help="use only the first N corpus files (sorted by path)")
    p.add_argument("--corpus-root", type=Path, default=None,
                   help="directory of .py files to train on (default: the stdlib)")
    p.add_argument("--include-tests", action="store_true",
                   help="also train on the stdlib test suites (excluded by default)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint of the stage(s) being run")
    p.add_argument("--threads", type=_threads, default=2,
                   help="torch CPU threads (default 2); 'auto' picks 1 or 2 per step by measured "
                        "step time, which avoids 2-thread slowdowns when the CPU is shared")
    p.add_argument("--init-target", type=Path, default=None,
                   help="continue training this target checkpoint (and keep its tokenizer) "
                        "instead of training one from scratch")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    return p


def _threads(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer or 'auto', got {text}")
    return int(text)


def _configure_distill(p: argparse.ArgumentParser, steps: int = 1000, lr: float = 2e-3) -> argparse.ArgumentParser:
    """The flags every student trained on a frozen target shares (draft, exit head)."""
    p.add_argument("--target", required=True,
                   help="the target: model name, HF directory, .gguf file or hub id (Llama, Qwen2, "
                        "Mistral, GPT-2, or any causal LM transformers loads)")
    p.add_argument("--out", type=Path, required=True, help="the directory to write")
    p.add_argument("--data", nargs="+", required=True, metavar="PATH",
                   help="text, source or JSONL ('text' field) files, directories of them "
                        "(recursive), or 'stdlib' (the embedded corpus' train split)")
    p.add_argument("--steps", type=positive_int, default=steps, help=f"optimizer steps (default {steps})")
    p.add_argument("--seq-len", type=positive_int, default=512,
                   help="tokens per training window, at most the target's context (default 512)")
    p.add_argument("--batch-size", type=positive_int, default=4, help="windows per step (default 4)")
    p.add_argument("--lr", type=positive_float, default=lr, help=f"peak learning rate (default {lr:g})")
    p.add_argument("--warmup", type=non_negative_int, default=20, help="warmup steps (default 20)")
    p.add_argument("--kl-weight", type=non_negative_float, default=1.0,
                   help="weight of KL(target || student), a target pass per window (default 1); draft: 0 "
                        "trains on hard labels alone, no target pass, the right choice on data the target "
                        "generated itself (`train data`), scoring only the draft vocabulary")
    p.add_argument("--ce-weight", type=non_negative_float, default=0.1, help="weight of the CE on the text (default 0.1)")
    p.add_argument("--ckpt-every", type=positive_int, default=50, help="checkpoint interval (steps)")
    p.add_argument("--log-every", type=positive_int, default=10, help="log interval (steps)")
    p.add_argument("--probe-every", type=non_negative_int, default=50, metavar="N",
                   help="every N steps, decode a few held-out prompts with the drafter being trained and "
                        "log its acceptance (TensorBoard probe/*; default 50, 0 = never)")
    p.add_argument("--eval-tokens", type=positive_int, default=32768,
                   help="held-out tokens scored for the agreement figure (default 32768)")
    p.add_argument("--seed", type=int, default=0, help="draft init and batch order")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="checkpoints and log (default: OUT-work next to OUT)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint (same settings and data)")
    p.add_argument("--force", action="store_true",
                   help="allow an --out inside the installed package or a non-empty directory")
    p.add_argument("--threads", type=_threads, default=None,
                   help="torch CPU threads, or 'auto' (1 or 2 per step by measured speed)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.add_argument("--device", default="cpu",
                   help="where the target and the student run while training, e.g. 'cuda' (default cpu); "
                        "the saved files are the same either way")
    return p


def _loss_on(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--loss-on", choices=["answers", "all"], default=None,
                   help=f"{what}. answers (default): in self-distillation shards (`quickdraft train data`), only "
                        "what the target wrote, not the prompts it answered (chat template, instruction, code to "
                        "complete), which a drafter never drafts (EAGLE's and Medusa's recipes); other text "
                        "counts whole. all: every token")


def _teacher(p: argparse.ArgumentParser) -> None:
    p.add_argument("--teacher", choices=["auto", "float32"], default="auto",
                   help="the weights the target's passes (the logits and states it learns from) run on. auto "
                        "(default): as generation runs the target here, so on a CPU with quickdraft's kernels a "
                        "GGUF file's own int4/int8 weights (the logits verification accepts, about 2x faster "
                        "than float32), else float32. float32: the dequantized float32 weights")


def _configure_draft(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    _configure_distill(p)
    _loss_on(p, "the tokens the loss counts (the held-out figures count every token)")
    start = p.add_mutually_exclusive_group()
    start.add_argument("--init", default=None,
                       help="start from this draft: embedded name or directory, with the target's tokenizer")
    start.add_argument("--config", default="auto",
                       help="size of a new Llama draft: auto (default: sized from the target, "
                            "a decode step about a tenth of the target's), small (1 layer, 256 "
                            "wide), tiny, or JSON (a file or inline) with hidden_size, "
                            "num_hidden_layers, num_attention_heads, intermediate_size")
    p.add_argument("--from-target", action="store_true",
                   help="start from the target's own weights (configuration, embeddings, final norm and "
                        "evenly spaced layers) instead of random ones; the draft must be as wide as the "
                        "target (--config auto is when the draft vocabulary leaves room)")
    p.add_argument("--draft-vocab", type=non_negative_int, default=None, metavar="N",
                   help="tokens the draft scores when drafting: the N most frequent in the training text "
                        "(written to draft_vocab.json; default: an eighth of the vocabulary, at least 1024; "
                        "0 = all). Generation overrides it with --draft-vocab")
    return p


def _configure_exit_head(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    _configure_distill(p, steps=300, lr=1e-3)
    _loss_on(p, "the tokens the loss counts (the held-out figures count every token)")
    _teacher(p)
    p.add_argument("--exit-layer", type=positive_int, required=True,
                   help="the head reads the target's residual stream after this many layers (1..layers-1)")
    p.add_argument("--extra-block", action="store_true",
                   help="put one trainable transformer block (initialised from the target's next layer) "
                        "in front of the head")
    p.add_argument("--draft-vocab", type=non_negative_int, default=None, metavar="N",
                   help="tokens its draft steps score: the N most frequent in the training text, through the "
                        "target's LM head rows for them (written to draft_vocab.json; default: an eighth of the "
                        "vocabulary, at least 1024; 0 = all). Generation overrides it with --draft-vocab")
    return p


def _configure_heads(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    _configure_distill(p, steps=300, lr=1e-3)
    p.add_argument("--kind", choices=["medusa", "prophet", "eagle"], default="medusa",
                   help="medusa: K residual heads on the target's final state, head i predicting the token "
                        "i + 2 places ahead (default); prophet: a small decoder fed the target's last final "
                        "states, then its own tokens, drafting a chain; eagle: fc([token; feature]) + one decoder "
                        "layer + the target's LM head, predicting the target's next feature (--kl-weight weighs its "
                        "soft cross-entropy against the target, --reg-weight the feature regression)")
    p.add_argument("--num-heads", type=positive_int, default=4, help="medusa: heads, i.e. tree levels (default 4)")
    p.add_argument("--n-start", type=positive_int, default=1,
                   help="prophet: target states fed first, those of the last N accepted tokens (default 1)")
    p.add_argument("--gamma", type=positive_int, default=4,
                   help="prophet: tokens drafted per round in training, windows of gamma + 2 tokens (default 4)")
    p.add_argument("--layers", type=positive_int, default=1, help="prophet: decoder layers (default 1)")
    p.add_argument("--width", type=positive_int, default=None,
                   help="prophet: decoder width (default: the target's; another width maps the states linearly)")
    p.add_argument("--prophet-heads", type=positive_int, default=None,
                   help="prophet: attention heads (default: the target's)")
    p.add_argument("--project", action="store_true",
                   help="prophet: a bias-free linear map of the states even at the target's width")
    p.add_argument("--ttt-steps", type=positive_int, default=5,
                   help="eagle: training-time test, steps unrolled on the drafter's own features (default 5)")
    p.add_argument("--blind-share", type=float, default=0.0, metavar="P",
                   help="eagle: the share of windows read with zero features, as a chain drafts in the first "
                        "round, before the prefill has made the prompt's features (default 0)")
    _loss_on(p, "the tokens the loss and the held-out agreement count")
    _teacher(p)
    p.add_argument("--reg-weight", type=non_negative_float, default=0.5,
                   help="eagle: weight of the SmoothL1 feature regression (default 0.5)")
    p.add_argument("--init", type=Path, default=None, metavar="DIR",
                   help="medusa, eagle: start from heads trained before for this target (e.g. a shipped "
                        "directory) and train on with this run's data; an EAGLE drafter keeps its draft "
                        "vocabulary, widened by --draft-vocab N to include this text's N most frequent tokens "
                        "(default: fresh weights)")
    p.add_argument("--from-draft", default=None, metavar="MODEL",
                   help="eagle: a layer of this one-layer draft model's shape instead of the target's (e.g. "
                        "qd-stdlib-draft: 256 wide against the target's 448), with its own embedding, norm and LM "
                        "head rows, the target's features mapped to its width; it starts as the draft (the same "
                        "proposals) and learns what the features add. A cheaper step; soft cross-entropy only")
    p.add_argument("--feature-layers", default=None, metavar="L1,L2,...",
                   help="eagle: the target layers whose outputs it reads, fused through its feature map "
                        "(EAGLE-3: low, middle and final, e.g. 2,5,8 of 8 layers; default: the final state alone; "
                        "a drafter of the target's width ends them with the final layer). With --init, a new "
                        "layer's share of the map starts at zero, so the drafter starts as it was")
    p.add_argument("--draft-vocab", type=non_negative_int, default=None, metavar="N",
                   help="eagle: its LM head scores the N most frequent tokens of the training text (default: "
                        "an eighth of the vocabulary, at least 1024; 0 = all)")
    return p


def _configure_data(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--target", required=True, help="the model that writes the data: name, directory or .gguf file")
    p.add_argument("--out", type=Path, required=True,
                   help="the shard directory (created; running again adds shards to it)")
    p.add_argument("--tokens", type=positive_int, required=True,
                   help="stop once the shards hold this many generated tokens")
    p.add_argument("--batch-size", type=positive_int, default=16,
                   help="rows generated at once by the batched engine (default 16: on a 2-core CPU "
                        "SmolLM2-135M (int4) writes ~520 tokens/s at 16 rows, ~500 at 32; the same "
                        "documents either way; on a GPU use 128 or more)")
    p.add_argument("--shard-jobs", type=positive_int, default=64,
                   help="prompts per shard (default 64): the unit written atomically and resumed")
    p.add_argument("--temperature", type=non_negative_float, default=0.8,
                   help="sampling temperature for diversity (default 0.8; 0 = greedy: the text greedy "
                        "decoding verifies, where SmolLM2's EAGLE drafter gained most, docs/smollm2/bench.md; "
                        "self-instruct questions are sampled at 1.0 either way, and a greedy directory asks "
                        "each of the ~1,900 built-in instructions once: its later chat jobs are self-instruct "
                        "jobs)")
    p.add_argument("--mix", default=None,
                   help="jobs of each kind out of every sum, e.g. chat=6,self-instruct=3,code=1 (default: "
                        "the directory's own, else chat=4,self-instruct=2,code=4). chat: a built-in "
                        "instruction answered; self-instruct: the target asks, then answers; code: it "
                        "continues a stdlib file")
    p.add_argument("--max-new-tokens", type=positive_int, default=160,
                   help="tokens the target writes per answer or completion (default 160)")
    p.add_argument("--seed", type=int, default=0, help="which prompts and samples (default 0)")
    p.add_argument("--max-seconds", type=positive_int, default=None,
                   help="start no shard that would end after this many seconds (run again to continue)")
    p.add_argument("--device", default="cpu",
                   help="where the target generates, e.g. 'cuda' (there in bfloat16; default cpu, float32); "
                        "a shard directory keeps one precision")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return p


def _configure_datastore(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--target", required=True,
                   help="the target that wrote the data (model name, HF directory or .gguf file; native runtime)")
    p.add_argument("--data", nargs="+", required=True, type=Path, metavar="DIR",
                   help="`quickdraft train data` output directories")
    p.add_argument("--out", type=Path, required=True, help="the datastore directory to write")
    p.add_argument("--max-ngram", type=positive_int, default=8,
                   help="longest tail a lookup matches (default 8; at least 2)")
    p.add_argument("--no-holdout", action="store_true",
                   help="keep documents that ask a bench prompt (by default they are left out, so bench "
                        "figures never measure copies of their own answers)")
    p.add_argument("--force", action="store_true", help="allow --out inside the installed package")
    return p


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``train`` sub-command (and ``train draft``) to an argparse ``subparsers``."""
    p = subparsers.add_parser(
        "train", help="train the embedded model family, or a draft for any target (train draft)",
        description=__doc__.split("\n\n")[0])
    _configure(p)
    p.set_defaults(func=run_train)
    sub = p.add_subparsers(dest="train_command", metavar="{data,datastore,draft,exit-head,heads}")
    g = sub.add_parser("data", help="the target writes its own training data (self-distillation shards)",
                       description="Self-distillation data: the target answers built-in instructions and "
                                   "instructions it writes itself through its chat template, and continues "
                                   "stdlib code, sampled with the batched engine into resumable shards. "
                                   "Train a draft on them with `quickdraft train draft --data OUT`.")
    _configure_data(g)
    g.set_defaults(func=run_train_data)
    s = sub.add_parser("datastore", help="a retrieval datastore from the target's own text (train data shards)",
                       description="Store the documents a target wrote (`quickdraft train data` directories) for "
                                   "retrieval drafting: --method ngram, hybrid and hybrid-eagle look a sequence's "
                                   "tail up there when it occurs nowhere earlier in the sequence, and propose the "
                                   "continuation most of its matches share. The bench's prompts are held out.")
    _configure_datastore(s)
    s.set_defaults(func=run_train_datastore)
    d = sub.add_parser("draft", help="distil a draft model for any target",
                       description="Distil a draft for a target: KL(target || draft) + CE on "
                                   "your text, with the target's tokenizer.")
    _configure_draft(d)
    d.set_defaults(func=run_train_draft)
    e = sub.add_parser("exit-head", help="distil an early-exit head for any target the native runtime loads",
                       description="Distil an early-exit head on a frozen target: KL(target || head) + CE on "
                                   "your text, read from the target's residual stream after --exit-layer.")
    _configure_exit_head(e)
    e.set_defaults(func=run_train_exit_head)
    h = sub.add_parser("heads", help="distil heads that read a target's hidden states (Medusa, prophet, EAGLE)",
                       description="Distil heads on a frozen target that the native runtime loads. Medusa: head i "
                                   "learns the target's own distribution i + 2 tokens ahead (KL + CE on your text). "
                                   "Prophet: a small decoder fed the target's last states drafts a chain. EAGLE: one "
                                   "layer learns the target's next feature and distribution, unrolled on its own "
                                   "features as it drafts. Use them with `quickdraft generate --method "
                                   "medusa|prophet|eagle --heads OUT`.")
    _configure_heads(h)
    h.set_defaults(func=run_train_heads)
    return p


def check_out(out: Path, force: bool) -> None:
    """Refuse to write into the installed package without ``--force``, or where nothing
    can be written (before the training, not after it)."""
    if not force and Path(out).resolve().is_relative_to(PACKAGE_DIR):
        raise TrainInputError(f"--out {out} is inside the installed quickdraft package; pass "
                              "another directory, or --force to overwrite what is shipped")
    check_writable(out, "--out", TrainInputError, directory=True)


def default_work_dir(out: Path) -> Path:
    if Path(out).resolve() == ASSETS_DIR.resolve():
        return Path("runs") / "train"
    return Path(out) / "_work"


def _command(args) -> str:
    """The command line as typed, for model cards."""
    argv = getattr(args, "_argv", None) or sys.argv[1:]
    if argv and argv[0] == "train":
        argv = argv[1:]
    return ("quickdraft train " + shlex.join(argv)).strip()


def run_train_data(args) -> int:
    from .selfdistill import run_train_data as run

    check_out(args.out, False)
    return run(args, log=lambda m: print(m, file=sys.stderr, flush=True))


def run_train_datastore(args) -> int:
    from .datastore import run_train_datastore as run

    if args.max_ngram < 2:
        raise TrainInputError(f"--max-ngram must be at least 2 (a lookup matches two tokens first), got {args.max_ngram}")
    check_out(args.out, args.force)
    return run(args, _command(args), log=lambda m: print(m, file=sys.stderr, flush=True))


def run_train_draft(args) -> int:
    from transformers.utils import logging

    from .draft import run_train_draft as run

    check_out(args.out, args.force)
    logging.disable_progress_bar()  # transformers' load/save bars: noise next to ours
    return run(args, _command(args), log=lambda m: print(m, file=sys.stderr, flush=True))


def run_train_exit_head(args) -> int:
    from .exit_head import run_train_exit_head as run

    check_out(args.out, args.force)
    return run(args, _command(args), log=lambda m: print(m, file=sys.stderr, flush=True))


def run_train_heads(args) -> int:
    args.loss_on = args.loss_on or "answers"
    # Options only an EAGLE drafter has: another kind would drop them without a word.
    eagle_only = [flag for flag, given in (("--from-draft", args.from_draft is not None),
                                           ("--feature-layers", args.feature_layers is not None)) if given]
    if eagle_only and args.kind != "eagle":
        raise TrainInputError(f"{eagle_only[0]} is for --kind eagle (drop it for --kind {args.kind})")
    if args.kind == "prophet":
        if args.init is not None:
            raise TrainInputError("--init is for --kind medusa or eagle; train a prophet from scratch "
                                  "(drop --init)")
        from .prophet import run_train_prophet as run
    else:
        from .heads import run_train_heads as run

    check_out(args.out, args.force)
    return run(args, _command(args), log=lambda m: print(m, file=sys.stderr, flush=True))


def run_train(args) -> int:
    import torch

    from .pipeline import STAGES, Pipeline
    from .presets import get_preset

    if args.out is None:
        if not args.force:
            raise TrainInputError(
                "pass --out DIR for the trained models (training never writes into the "
                "installed package; --force without --out overwrites the embedded family)")
        args.out = ASSETS_DIR
    check_out(args.out, args.force)
    threads = args.threads
    torch.set_num_threads(2 if threads == "auto" else threads)
    preset = get_preset(args.preset, target_steps=args.target_steps,
                        draft_steps=args.draft_steps)
    work = args.work_dir or default_work_dir(args.out)
    command = _command(args)
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
    try:
        return args.func(args)
    except ValueError as exc:  # bad input (TrainInputError, CheckpointError): one line
        print(f"quickdraft: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
