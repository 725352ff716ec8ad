"""``make demo``: the main job on the embedded models, shown to a person."""

from __future__ import annotations

import argparse
import sys

from .cli import GREEN, RESET, use_color

DEMO_PROMPT = '''def median(values):
    """Return the median of a non-empty list of numbers."""
'''


def run_demo(args: argparse.Namespace) -> int:
    from .generator import SpeculativeGenerator

    color = use_color("auto")
    print("quickdraft demo: speculative decoding on the embedded models (greedy, output identical to plain decoding)")
    gen = SpeculativeGenerator.from_pretrained()
    print(f"\n--- completion (draft-model speculative decoding{', ' + GREEN + 'green' + RESET + ' = accepted draft tokens' if color else ''}) ---")
    sys.stdout.write(DEMO_PROMPT)
    from .stats import GenerationStats

    stats = GenerationStats()
    for chunk in gen.stream(DEMO_PROMPT, max_new_tokens=args.max_new_tokens, stats=stats):
        for text, from_draft in chunk.segments:
            sys.stdout.write(f"{GREEN}{text}{RESET}" if color and from_draft else text)
        sys.stdout.flush()
    print(f"\n--- {stats.summary()}")
    print("\n--- comparison with plain decoding: `quickdraft bench --quick` (greedy, same prompts, one process) ---")
    from .bench.cli import run_bench
    from .cli import build_parser

    return run_bench(build_parser().parse_args(["bench", "--quick"]))
