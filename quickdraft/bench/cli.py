"""``quickdraft bench``: the benchmark sub-command."""

from __future__ import annotations

import argparse
import shlex
import sys
import time

from ..cli import add_placement_options
from ..jsonl import check_writable
from ..quiet import quiet_transformers
from .config import (
    BACKENDS,
    BASELINE_METHODS,
    BASELINES,
    DEFAULT_METHODS,
    DEFAULT_THREADS,
    FULL,
    LLAMA_CPP_DRAFT_MAX,
    MAX_K,
    QUICK,
    BenchConfig,
    BenchError,
)
from .prompts import ALL_CATEGORIES, CATEGORIES, INSTRUCT_CATEGORIES, PromptFileError


def _span(values) -> str:
    return f"{values[0]}-{values[-1]}" if values else "none"


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
    p.add_argument("--model", help="target: model name, directory or .gguf file (default: the embedded default)")
    p.add_argument("--draft", help="draft model (default: the target's paired embedded draft)")
    p.add_argument("--backend", choices=BACKENDS,
                   help="model runtime, as for generate: native, hf (transformers) or auto = native "
                        f"when it supports the checkpoint, else transformers (default {BenchConfig.backend})")
    p.add_argument("--methods", help=f"comma-separated methods (default: {','.join(DEFAULT_METHODS)}, and the "
                   "method a model names for itself after ar: auto for smollm2-135m)")
    p.add_argument("--categories", metavar="NAMES",
                   help=f"comma-separated prompt categories: {', '.join(ALL_CATEGORIES)} (default: "
                        f"{','.join(CATEGORIES)}; for a packaged instruct model such as smollm2-135m: "
                        f"{','.join(INSTRUCT_CATEGORIES)}; with --prompts, the file's 'category' values)")
    p.add_argument("--prompts", metavar="FILE.jsonl",
                   help="JSON lines with 'id' and 'prompt', optionally 'category' (default: the built-in "
                        "categories)")
    p.add_argument("--max-new-tokens", type=int,
                   help=f"tokens per generation (default {FULL.max_new_tokens}; quick {QUICK.max_new_tokens})")
    p.add_argument("--repeats", type=int,
                   help=f"timed repeats per prompt and method (default {FULL.repeats}; quick {QUICK.repeats})")
    p.add_argument("--temperature", type=float, help="0 = greedy (default); > 0 samples, seeded")
    p.add_argument("--seed", type=int, help=f"base seed of sampled runs (default {BenchConfig.seed})")
    p.add_argument("-k", "--k", type=int, dest="k",
                   help="draft tokens per step for draft and hf-assisted (default: the cost model's choice)")
    p.add_argument("--sweep", help="extra draft rows at these k: '1-8', '2,4,6' or 'none' "
                                   f"(default {_span(FULL.sweep)}; quick {_span(QUICK.sweep)})")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--plot", metavar="DIR", help="write PNG plots and report.md into DIR")
    p.add_argument("--markdown", metavar="FILE", help="write the Markdown report here")
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK.prompts} prompts per category, {QUICK.max_new_tokens} tokens, {QUICK.repeats} repeat, "
                        f"k sweep {_span(QUICK.sweep)}")
    p.add_argument("--batch-size", metavar="SIZES",
                   help="batched throughput instead: plain vs speculative decoding with this many rows at "
                        "a time, e.g. 1,4,8 (methods ar, draft, ngram, hybrid, early-exit with the shipped "
                        "head; k from the batch policy unless -k; docs/batching.md)")
    p.add_argument("--draft-vocab", type=int, metavar="N",
                   help="the draft model and the heads (EAGLE, prophet, trained exit heads) score only their "
                        "N most frequent tokens (default: each one's draft_vocab.json size; 0 = all)")
    p.add_argument("--baseline", choices=BASELINES,
                   help="add another tool's rows: llama.cpp = llama-completion (plain) and "
                        "llama-speculative-simple (same draft), same weights as GGUF (docs/llama_cpp.md)")
    p.add_argument("--llama-cpp", metavar="DIR",
                   help="directory of llama.cpp's binaries (default: $QUICKDRAFT_LLAMA_CPP, else "
                        "llama-completion's on PATH)")
    p.add_argument("--llama-cpp-draft-max", metavar="LIST",
                   help="llama.cpp-spec rows at these --spec-draft-n-max values "
                        f"(default {','.join(map(str, LLAMA_CPP_DRAFT_MAX))})")
    add_placement_options(p)
    p.add_argument("--threads", type=int, help=f"torch CPU threads (default {DEFAULT_THREADS})")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=run_bench)
    return p


def _parse_sweep(text: str | None) -> tuple[int, ...] | None:
    """``--sweep`` text as k values (None when not given: the preset's)."""
    if text is None:
        return None
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
        raise BenchError(f"--sweep must look like '1-8' or '2,4,6', got {text!r}") from None
    if any(k < 1 or k > MAX_K for k in out):
        raise BenchError(f"--sweep values must be between 1 and {MAX_K}")
    return tuple(dict.fromkeys(out))


def _parse_draft_max(text: str | None) -> tuple[int, ...] | None:
    """``--llama-cpp-draft-max`` text ('4,8,12') as ints (None when not given)."""
    if text is None:
        return None
    try:
        return tuple(dict.fromkeys(int(part) for part in text.split(",") if part.strip()))
    except ValueError:
        raise BenchError(f"--llama-cpp-draft-max must look like '4,8,12', got {text!r}") from None


def command_line(args) -> str:
    """The ``quickdraft bench`` command equivalent to ``args`` (for the report)."""
    parts = ["quickdraft", "bench"]
    for flag, dest in [("--model", "model"), ("--draft", "draft"), ("--backend", "backend"), ("--methods", "methods"),
                       ("--categories", "categories"), ("--prompts", "prompts"), ("--max-new-tokens", "max_new_tokens"),
                       ("--repeats", "repeats"), ("-k", "k"), ("--sweep", "sweep"),
                       ("--draft-vocab", "draft_vocab"), ("--baseline", "baseline"),
                       ("--llama-cpp", "llama_cpp"), ("--llama-cpp-draft-max", "llama_cpp_draft_max"),
                       ("--json", "json"),
                       ("--plot", "plot"), ("--markdown", "markdown")]:
        value = getattr(args, dest, None)
        if value is not None:
            parts += [flag, str(value)]
    if getattr(args, "temperature", None):
        parts += ["--temperature", str(args.temperature)]
        if getattr(args, "seed", None) is not None:
            parts += ["--seed", str(args.seed)]
    for flag, dest, default in [("--device", "device", "cpu"), ("--dtype", "dtype", "auto"),
                                ("--quantize", "quantize", "auto"), ("--kv-cache", "kv_cache", "auto")]:
        if getattr(args, dest, default) != default:
            parts += [flag, str(getattr(args, dest))]
    if getattr(args, "threads", None) is not None:
        parts += ["--threads", str(args.threads)]
    if getattr(args, "quick", False):
        parts.append("--quick")
    return shlex.join(parts)


def default_categories(model: str | None) -> tuple[str, ...]:
    """The built-in categories a model is benched on by default: chat and code for the
    packaged instruct models (what users ask of them), else the embedded family's."""
    from ..models.registry import find_packaged

    return INSTRUCT_CATEGORIES if model is not None and find_packaged(str(model)) else CATEGORIES


def run_bench(args) -> int:
    """Run the benchmark; bad input prints one line to stderr and returns 2."""
    started = time.perf_counter()
    try:
        return _run(args, started)
    except (BenchError, PromptFileError) as exc:
        print(f"quickdraft bench: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # BenchError, CheckpointError, tokenizer mismatch, ...
        print(f"quickdraft bench: error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("quickdraft bench: interrupted", file=sys.stderr)
        return 130


def default_methods(model: str | None, draft: str | None) -> tuple[str, ...] | None:
    """The rows a bench without ``--methods`` runs: :data:`DEFAULT_METHODS`, with the
    method the model decodes with by default beside plain decoding where that is another
    (smollm2-135m: auto); None for the config's own default."""
    from ..models.registry import DEFAULT_METHOD, default_method

    method = default_method(model, draft)
    return None if method == DEFAULT_METHOD else tuple(dict.fromkeys(["ar", method, *DEFAULT_METHODS]))


def _run(args, started: float) -> int:
    from .context import load_context
    from .prompts import builtin_prompts, load_prompts, parse_categories, select
    from .runner import run_benchmark

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip()) if args.methods is not None else None
    if methods == ():
        raise BenchError("--methods is empty")
    if methods is None and getattr(args, "batch_size", None) is None:
        methods = default_methods(args.model, args.draft)
    baseline = getattr(args, "baseline", None)
    llama_dir = None
    if baseline:
        methods = tuple(dict.fromkeys([*(methods or DEFAULT_METHODS), *BASELINE_METHODS[baseline]]))
    if methods and any(m.startswith("llama.cpp") for m in methods):
        from .llama_cpp import which

        llama_dir = which(getattr(args, "llama_cpp", None))
    draft_max = getattr(args, "llama_cpp_draft_max", None)
    sizes = None
    if getattr(args, "batch_size", None):
        if llama_dir is not None:
            raise BenchError("--baseline llama.cpp runs batch 1 only; drop --batch-size")
        from .batch import parse_batch_sizes

        sizes = parse_batch_sizes(args.batch_size)
        if methods is not None and set(methods) == {"ar"}:
            from ..drafters.factory import BATCH_METHODS

            raise BenchError("--batch-size compares methods with plain decoding (ar, always run); add one of "
                             + ", ".join(m for m in BATCH_METHODS if m != "ar"))
        methods = methods or ("ar", "draft")
    for flag, path in (("--json", args.json), ("--markdown", args.markdown), ("--plot", args.plot)):
        if path:
            check_writable(path, flag, BenchError, directory=flag == "--plot")
    config = BenchConfig.create(
        quick=args.quick, model=args.model, draft=args.draft, backend=args.backend, methods=methods,
        max_new_tokens=args.max_new_tokens, repeats=args.repeats, temperature=args.temperature,
        seed=args.seed, k=args.k, sweep=_parse_sweep(args.sweep), threads=args.threads,
        draft_vocab=args.draft_vocab, device=args.device, dtype=args.dtype,
        llama_cpp=llama_dir, llama_cpp_draft_max=_parse_draft_max(draft_max),
        quantize=getattr(args, "quantize", "auto"), kv_cache=getattr(args, "kv_cache", "auto"),
    )
    if llama_dir is not None or (methods and any(m.startswith("llama.cpp") for m in methods)):
        from .llama_cpp import check_before_loading

        check_before_loading(config)
    per_category = QUICK.prompts if args.quick else FULL.prompts
    if args.prompts:
        prompts = select(load_prompts(args.prompts), parse_categories(args.categories, None), per_category)
    else:
        prompts = builtin_prompts(parse_categories(args.categories) or default_categories(args.model), per_category)

    log = (lambda msg: None) if args.quiet else (lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True))
    log("loading models")
    ctx = load_context(config)
    if sizes is not None:
        from .batch import print_batch_table, run_batch_benchmark

        with quiet_transformers():
            result = run_batch_benchmark(ctx, prompts, config, sizes, log=log)
        result["command"] = command_line(args) + f" --batch-size {args.batch_size}"
        print_batch_table(result)
        if args.json:
            from .report import write_json

            write_json(result, args.json)
            print(f"wrote {args.json}")
        return 0
    with quiet_transformers():
        result = run_benchmark(ctx, prompts, config, log=log)
    result["config"]["seconds"] = time.perf_counter() - started
    result["config"]["command"] = command_line(args)

    from . import report

    report.print_table(result)
    for line in result["warnings"]:
        print(f"warning: {line}", file=sys.stderr)
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




def main(argv: list[str] | None = None) -> int:
    """``python -m quickdraft.bench.cli ...`` (the same as ``quickdraft bench ...``)."""
    parser = argparse.ArgumentParser(prog="quickdraft")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
