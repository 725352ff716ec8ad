"""One C call per block (``cpu_kernels.block``) against the per-op fused path, interleaved
pass by pass in one process (this host's speed drifts between processes).

    python scripts/block_ab.py [MODEL]     # default smollm2-135m (make real-model)

Prints the median wall time of a pass of 1, 3, 6 and 9 tokens after a 128-token context,
each path, and their ratio. The two paths give the same logits bit for bit
(tests/test_layer_ops.py); only their speed differs.
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's quickdraft
from quickdraft.models import transformer  # noqa: E402
from quickdraft.models.lm import load_model  # noqa: E402


def per_op(self):  # Block.kernel_specs standing in: "no block call", so the per-op path runs
    return None


def main() -> None:
    lm = load_model(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m")
    block = transformer.Block.kernel_specs
    gen = torch.Generator().manual_seed(0)
    context = 128
    lm.reset(context + 16)
    lm.extend(torch.randint(0, lm.vocab_size, (context,), generator=gen), logits="none")
    try:
        for width in (1, 3, 6, 9):
            tokens = torch.randint(0, lm.vocab_size, (width,), generator=gen)
            times: dict[str, list[float]] = {"per-op": [], "block": []}
            for i in range(240):
                order = [("block", block), ("per-op", per_op)]
                for name, specs in order if i % 2 else order[::-1]:
                    transformer.Block.kernel_specs = specs
                    lm.crop(context)
                    start = time.perf_counter()
                    lm.extend(tokens, logits="all")
                    if i >= 40:  # the first 40 rounds warm up
                        times[name].append(time.perf_counter() - start)
            a, b = (statistics.median(times[name]) * 1e3 for name in ("per-op", "block"))
            print(f"width {width}: per-op {a:.2f} ms, block {b:.2f} ms, block / per-op {b / a:.3f}")
    finally:
        transformer.Block.kernel_specs = block


if __name__ == "__main__":
    main()
