"""A/B in one process: greedy speculative rounds several at a time in one C call (session 45,
``engine.SPEC_CHUNK``) against one round at a time through the engine's Python loop.

    python docs/bench/spec_rounds_ab.py [--model smollm2-135m] [--repeats 2] [eagle:2 hybrid-eagle:6 eagle:12@dv]

Every ``METHOD[:K][@DRAFT_STOP]`` and plain decoding decode the bench's chat and code prompts (128
tokens), both ways, alternating the order prompt by prompt; outputs must be identical (plain
decoding's). Prints, per category, decode tokens/s summed over the prompts, each way's
speedup over plain decoding measured beside it, and new / old. Take the CPU lock first
(``flock /tmp/quickdraft-cpu.lock``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's quickdraft
from quickdraft import SpeculativeGenerator  # noqa: E402
from quickdraft.bench.prompt_sets import build_code, category_file  # noqa: E402
from quickdraft.bench.prompts import load_prompts  # noqa: E402
from quickdraft.decoding import engine  # noqa: E402
from quickdraft.drafters import DraftOptions  # noqa: E402

CHUNK = engine.SPEC_CHUNK


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("methods", nargs="*", default=["eagle:2", "hybrid-eagle:6"])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(2)
    plain = SpeculativeGenerator.from_pretrained(args.model, method="ar")
    gens = {spec: SpeculativeGenerator.from_pretrained(
        args.model, method=spec.partition(":")[0].partition("@")[0],
        options=DraftOptions(draft_stop=spec.partition("@")[2] or "fixed")) for spec in args.methods}
    categories = {"chat": load_prompts(category_file("chat")), "code": build_code()}
    runs = [("ar", None, plain)] + [(spec, way, gens[spec]) for spec in args.methods for way in ("new", "old")]
    for category, prompts in categories.items():
        seconds = {(spec, way): 0.0 for spec, way, _ in runs}
        tokens = dict.fromkeys(seconds, 0)
        for repeat in range(args.repeats):
            for i, prompt in enumerate(prompts):
                shift = (i + repeat) % len(runs)
                expected = None
                for spec, way, gen in runs[shift:] + runs[:shift]:
                    engine.SPEC_CHUNK = 0 if way == "old" else CHUNK
                    k = spec.partition("@")[0].partition(":")[2]
                    kwargs = {"max_new_tokens": args.max_new_tokens, **({"num_speculative_tokens": int(k)} if k else {})}
                    out = (gen.generate(messages=list(prompt.messages), **kwargs) if prompt.is_chat
                           else gen.generate(prompt.prompt, **kwargs))
                    if expected is not None and out.token_ids != expected:
                        raise SystemExit(f"{spec} ({way}) changed the output of {prompt.id}")
                    expected = out.token_ids
                    seconds[spec, way] += out.stats.decode_seconds
                    tokens[spec, way] += out.stats.new_tokens
        engine.SPEC_CHUNK = CHUNK
        rate = {key: tokens[key] / seconds[key] for key in seconds}
        base = rate["ar", None]
        print(f"{category} ({len(prompts)} prompts x {args.repeats}): plain decoding {base:.1f} tokens/s")
        for spec in args.methods:
            new, old = rate[spec, "new"], rate[spec, "old"]
            print(f"  {spec:16s} round by round {old:6.1f} tok/s ({old / base:.2f}x)   in C calls {new:6.1f} tok/s "
                  f"({new / base:.2f}x)   new / old {new / old:.3f}")


if __name__ == "__main__":
    main()
