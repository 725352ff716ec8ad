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
    plain = SpeculativeGenerator(gen.target, gen.tokenizer)
    print(f"\n--- completion (draft-model speculative decoding{', ' + GREEN + 'green' + RESET + ' = accepted draft tokens' if color else ''}) ---")
    sys.stdout.write(DEMO_PROMPT)
    from .stats import GenerationStats

    stats = GenerationStats()
    for chunk in gen.stream(DEMO_PROMPT, max_new_tokens=args.max_new_tokens, stats=stats):
        for text, from_draft in chunk.segments:
            sys.stdout.write(f"{GREEN}{text}{RESET}" if color and from_draft else text)
        sys.stdout.flush()
    print(f"\n--- {stats.summary()}")
    reference = plain.generate(DEMO_PROMPT, max_new_tokens=args.max_new_tokens)
    spec = gen.generate(DEMO_PROMPT, max_new_tokens=args.max_new_tokens)
    same = "identical" if reference.token_ids == spec.token_ids else "DIFFERENT (bug!)"
    print(
        f"plain decoding: {reference.stats.tokens_per_second:.1f} tok/s; speculative: "
        f"{spec.stats.tokens_per_second:.1f} tok/s -> {spec.stats.tokens_per_second / reference.stats.tokens_per_second:.2f}x, "
        f"mean accepted tokens {spec.stats.mean_accepted_tokens:.2f}; outputs {same}"
    )
    return 0
