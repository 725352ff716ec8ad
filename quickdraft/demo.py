"""``quickdraft demo`` (``make demo``): the main job on the embedded models, shown to a person."""

from __future__ import annotations

import argparse
import sys

from .argtypes import positive_int
from .console import green, use_color, write_stream
from .quiet import quiet_transformers

DEMO_PROMPT = '''def median(values):
    """Return the median of a non-empty list of numbers."""
'''


def add_demo_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``demo`` sub-command to an argparse subparsers object."""
    demo = subparsers.add_parser(
        "demo", help="stream a code completion, then compare with plain decoding",
        description="The main job on the embedded models: a streamed speculative completion "
        "with accepted draft tokens marked, then a quick benchmark.")
    demo.add_argument("--max-new-tokens", type=positive_int, default=96, help="tokens to generate (default 96)")
    demo.set_defaults(func=run_demo)
    return demo


def run_demo(args: argparse.Namespace) -> int:
    from .bench.cli import add_bench_parser
    from .generator import SpeculativeGenerator

    color = use_color("auto")
    print("quickdraft demo: speculative decoding on the embedded models "
          "(greedy, output identical to plain decoding)")
    with quiet_transformers():
        gen = SpeculativeGenerator.from_pretrained()
    choice = gen.tune_num_speculative_tokens(log=lambda msg: print(f"quickdraft: {msg}", file=sys.stderr))
    print(f"quickdraft: {choice.summary()}", file=sys.stderr)  # k, or why the draft is not used
    legend = f", {green('green', color)} = accepted draft tokens" if color else ""
    print(f"\n--- completion (draft-model speculative decoding, k={choice.k} from the cost model{legend}) ---")
    sys.stdout.write(DEMO_PROMPT)
    stream = gen.stream(DEMO_PROMPT, max_new_tokens=args.max_new_tokens)
    write_stream(stream, color)
    print(f"\n--- {stream.stats.summary()}")
    print("\n--- comparison with plain decoding: `quickdraft bench --quick` "
          "(greedy, same prompts, one process) ---")
    parser = argparse.ArgumentParser(prog="quickdraft")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    bench_args = parser.parse_args(["bench", "--quick"])
    return bench_args.func(bench_args)
