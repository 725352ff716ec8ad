"""Per-op time budget of one plain decode step and one verify pass of a native target.

    python scripts/step_budget.py [--model NAME] [--context 128] [--widths 1,9] [--steps 200]

Runs the real path (``NativeLM.extend``) after a prefill of ``--context`` tokens, rolling
the cache back after each pass so every timed pass sees the same context. Prints, per pass
width: the wall time per pass (median of ``--steps``), the aten calls per pass, and a
table of the ops that take the time (torch.profiler's CPU self time, per pass). The
profiler adds its own per-op overhead, so the table's total exceeds the wall time; read it
for shares and counts, the wall time for the step's cost.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's quickdraft, not an installed one
from quickdraft.models.lm import load_model  # noqa: E402
from quickdraft.models.registry import default_target  # noqa: E402


def wall_times(lm, tokens: torch.Tensor, context: int, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        lm.crop(context)
        t0 = time.perf_counter()
        lm.extend(tokens, logits="all")
        times.append(time.perf_counter() - t0)
    return times


def budget(lm, tokens: torch.Tensor, context: int, steps: int) -> tuple[list[tuple[str, int, float]], int]:
    """(name, calls per pass, self us per pass) rows, sorted by time; and aten calls per pass."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            lm.crop(context)
            lm.extend(tokens, logits="all")
    rows = [(e.key, e.count / steps, e.self_cpu_time_total / steps) for e in prof.key_averages()]
    aten = sum(calls for name, calls, _ in rows if name.startswith("aten::"))
    return sorted(rows, key=lambda r: -r[2]), round(aten)


#: Ops that are the arithmetic a step cannot avoid: matrix products and attention.
MATMUL = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
          "qdexp::linear", "quickdraft::packed_linear")
ATTENTION = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model name or path (default: the embedded target)")
    parser.add_argument("--context", type=int, default=128, help="tokens in the cache before each pass")
    parser.add_argument("--widths", default="1,9", help="tokens per pass (1 = plain step, 9 = verify of k=8)")
    parser.add_argument("--steps", type=int, default=200, help="timed passes per width")
    parser.add_argument("--top", type=int, default=14, help="ops listed per table")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--capture", action="store_true", help="run through the fixed-width static step")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    lm = load_model(args.model or default_target().path)
    widths = [int(w) for w in args.widths.split(",")]
    if args.capture:
        lm.use_static_step(max(widths))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, lm.vocab_size, (args.context,), generator=gen)
    lm.reset(args.context + max(widths) + 8)
    lm.extend(prompt, logits="none")
    import quickdraft

    print(f"quickdraft from {Path(quickdraft.__file__).parent}")
    print(f"model {args.model or 'embedded target'}: {lm.config.n_layers} layers, hidden {lm.config.hidden_size}, "
          f"context {args.context}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    for width in widths:
        tokens = torch.randint(0, lm.vocab_size, (width,), generator=gen)
        wall_times(lm, tokens, args.context, 20)  # warm-up
        wall = statistics.median(wall_times(lm, tokens, args.context, args.steps))
        rows, aten = budget(lm, tokens, args.context, max(20, args.steps // 4))
        total = sum(us for _, _, us in rows)
        print(f"\nwidth {width}: {wall * 1e3:.3f} ms per pass (median of {args.steps}), {aten} aten calls per pass, "
              f"profiled self time {total / 1e3:.3f} ms")
        print("| op | calls | us | share |\n|---|---:|---:|---:|")
        for name, calls, us in rows[: args.top]:
            print(f"| {name} | {calls:.0f} | {us:.0f} | {us / total:.0%} |")
        rest = sum(us for _, _, us in rows[args.top :])
        print(f"| (other {len(rows) - args.top} ops) | | {rest:.0f} | {rest / total:.0%} |")
        matmul = sum(us for name, _, us in rows if name in MATMUL)
        attention = sum(us for name, _, us in rows if name in ATTENTION)
        other = total - matmul - attention
        print(f"budget: matmul {matmul / total:.0%}, attention {attention / total:.0%}, "
              f"everything else {other / total:.0%} of the profiled time; at the wall time that is "
              f"{wall * 1e3 * matmul / total:.2f} / {wall * 1e3 * attention / total:.2f} / "
              f"{wall * 1e3 * other / total:.2f} ms")


if __name__ == "__main__":
    main()
