"""``quickdraft bench``: the benchmark sub-command."""

from __future__ import annotations

import argparse
import shlex
import sys
import time

QUICK = dict(prompts=4, max_new_tokens=64, repeats=1, sweep=())
FULL = dict(max_new_tokens=128, repeats=3, sweep=tuple(range(1, 9)))
DEFAULT_METHODS = ("ar", "draft", "hf-ar", "hf-assisted")


class _Usage(ValueError):
    pass


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``bench`` sub-command to an argparse subparsers object."""
    p = subparsers.add_parser(
        "bench",
        help="benchmark decoding methods (ours and transformers') on a prompt set",
        description=(
            "Run each method on each prompt (batch 1, after a warm-up, methods alternating in one "
            "process) and report tokens/s, speedup vs ar, acceptance, losslessness and the cost "
            "model's prediction."
        ),
    )
    p.add_argument("--model", help="target: embedded name or directory (default: the embedded default)")
    p.add_argument("--draft", help="draft model (default: the target's paired embedded draft)")
    p.add_argument("--methods", help=f"comma-separated methods (default: {','.join(DEFAULT_METHODS)})")
    p.add_argument("--prompts", metavar="FILE.jsonl",
                   help="JSON lines with 'id' and 'prompt' (default: the built-in validation-split set)")
    p.add_argument("--max-new-tokens", type=int, help="tokens per generation (default 128; quick 64)")
    p.add_argument("--repeats", type=int, help="timed repeats per prompt and method (default 3; quick 1)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples, seeded")
    p.add_argument("--seed", type=int, default=0, help="base seed of sampled runs")
    p.add_argument("-k", "--k", type=int, dest="k",
                   help="draft tokens per step for draft and hf-assisted (default: the cost model's choice)")
    p.add_argument("--sweep", help="extra draft rows at these k: '1-8', '2,4,6' or 'none' "
                                   "(default 1-8; none with --quick)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--plot", metavar="DIR", help="write PNG plots and report.md into DIR")
    p.add_argument("--markdown", metavar="FILE", help="write the Markdown report here")
    p.add_argument("--quick", action="store_true",
                   help="4 prompts, 64 tokens, 1 repeat, no k sweep (under 2 minutes on a 2-core CPU)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=run_bench)
    return p


def _parse_sweep(text: str | None, quick: bool) -> tuple[int, ...]:
    if text is None:
        return QUICK["sweep"] if quick else FULL["sweep"]
    text = text.strip().lower()
    if text in ("", "none", "off", "0"):
        return ()
    out: list[int] = []
    try:
        for part in text.split(","):
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                out.extend(range(lo, hi + 1))
            else:
                out.append(int(part))
    except ValueError:
        raise _Usage(f"--sweep must look like '1-8' or '2,4,6', got {text!r}") from None
    if any(k < 1 or k > 32 for k in out):
        raise _Usage("--sweep values must be between 1 and 32")
    return tuple(dict.fromkeys(out))


def command_line(args) -> str:
    """The ``quickdraft bench`` command equivalent to ``args`` (for the report)."""
    parts = ["quickdraft", "bench"]
    for flag, dest in [("--model", "model"), ("--draft", "draft"), ("--methods", "methods"),
                       ("--prompts", "prompts"), ("--max-new-tokens", "max_new_tokens"),
                       ("--repeats", "repeats"), ("-k", "k"), ("--sweep", "sweep"), ("--json", "json"),
                       ("--plot", "plot"), ("--markdown", "markdown")]:
        value = getattr(args, dest, None)
        if value is not None:
            parts += [flag, str(value)]
    if getattr(args, "temperature", 0.0):
        parts += ["--temperature", str(args.temperature), "--seed", str(args.seed)]
    if getattr(args, "threads", 2) != 2:
        parts += ["--threads", str(args.threads)]
    if getattr(args, "quick", False):
        parts.append("--quick")
    return shlex.join(parts)


def run_bench(args) -> int:
    """Run the benchmark; bad input prints one line to stderr and returns 2."""
    from .prompts import PromptFileError

    started = time.perf_counter()
    try:
        return _run(args, started)
    except (_Usage, PromptFileError) as exc:
        print(f"quickdraft bench: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # BenchError, CheckpointError, tokenizer mismatch, ...
        print(f"quickdraft bench: error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("quickdraft bench: interrupted", file=sys.stderr)
        return 130


def _run(args, started: float) -> int:
    from .config import BenchConfig
    from .context import load_context
    from .prompts import default_prompts, load_prompts, quick_subset
    from .registry import BENCH_METHODS, needs_draft
    from .runner import run_benchmark

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip()) if args.methods else DEFAULT_METHODS
    if not methods:
        raise _Usage("--methods is empty")
    unknown = [m for m in methods if m not in BENCH_METHODS]
    if unknown:
        raise _Usage(f"unknown method {unknown[0]!r}; choose from: {', '.join(BENCH_METHODS)}")
    repeats = args.repeats if args.repeats is not None else (QUICK if args.quick else FULL)["repeats"]
    if repeats < 1:
        raise _Usage(f"--repeats must be >= 1, got {repeats}")
    max_new = args.max_new_tokens if args.max_new_tokens is not None else (QUICK if args.quick else FULL)["max_new_tokens"]
    if max_new < 1:
        raise _Usage(f"--max-new-tokens must be >= 1, got {max_new}")
    if args.temperature < 0:
        raise _Usage(f"--temperature must be >= 0, got {args.temperature}")
    if args.k is not None and args.k < 1:
        raise _Usage(f"-k must be >= 1, got {args.k}")
    if args.threads is not None and args.threads < 1:
        raise _Usage(f"--threads must be >= 1, got {args.threads}")
    sweep = _parse_sweep(args.sweep, args.quick) if "draft" in methods else ()
    if args.prompts:
        prompts = load_prompts(args.prompts)
        if args.quick:
            prompts = quick_subset(prompts, QUICK["prompts"])
    else:
        prompts = default_prompts(quick=args.quick)

    log = (lambda msg: None) if args.quiet else (lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True))
    log("loading models")
    ctx = load_context(args.model, args.draft, needs_draft(methods))
    config = BenchConfig(
        model=args.model, draft=args.draft, methods=methods, max_new_tokens=max_new, repeats=repeats,
        temperature=args.temperature, seed=args.seed, k=args.k, sweep=sweep, quick=args.quick,
        threads=args.threads,
    )
    with _quiet_transformers():
        result = run_benchmark(ctx, prompts, config, log=log)
    result["config"]["seconds"] = time.perf_counter() - started
    result["config"]["command"] = command_line(args)

    from . import report

    report.print_table(result)
    for line in report.goal_checks(result):
        print(line)
    plots: list[str] = []
    if args.plot:
        from .plots import write_plots

        plots = write_plots(result, args.plot)
    markdown = args.markdown or (f"{args.plot}/report.md" if args.plot else None) or \
        (str(args.json)[: -len(".json")] + ".md" if args.json and str(args.json).endswith(".json") else None)
    if args.json:
        report.write_json(result, args.json)
        print(f"wrote {args.json}")
    if markdown:
        report.write_markdown(result, markdown, plots, result["config"].get("command"))
        print(f"wrote {markdown}")
    for p in plots:
        print(f"wrote {p}")
    print(f"bench finished in {result['config']['seconds']:.0f} s")
    return 0


class _quiet_transformers:
    """transformers warns about its own internal generate() arguments during assisted
    generation; keep the bench output readable."""

    def __enter__(self):
        try:
            from transformers.utils import logging

            self._level = logging.get_verbosity()
            logging.set_verbosity_error()
        except Exception:  # pragma: no cover
            self._level = None
        return self

    def __exit__(self, *exc):
        if self._level is not None:
            from transformers.utils import logging

            logging.set_verbosity(self._level)
        return False


def main(argv: list[str] | None = None) -> int:
    """``python -m quickdraft.bench.cli ...`` (the same as ``quickdraft bench ...``)."""
    parser = argparse.ArgumentParser(prog="quickdraft")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
