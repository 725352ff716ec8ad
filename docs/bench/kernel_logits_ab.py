"""Logits of this tree's kernels against an older commit's, in one process:

    python docs/bench/kernel_logits_ab.py REV [MODEL ...] [--quantize int8]

For each model (default: the embedded target, and SmolLM2 when installed), a 300-token
prefill of random tokens, then a 9-token and a 1-token pass, at 1 and 2 threads, with
REV's kernels (built as ``scripts/step_ab.py build`` builds them) and with this tree's.
Prints whether each pass's logits are equal bit for bit and, where not, the largest and
median difference and how often the prefill's argmax agrees: what a kernel change that
should be bit for bit (or one that changes rounding on purpose) did to the outputs.
"""

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
import step_ab  # noqa: E402

from quickdraft.models import cpu_kernels  # noqa: E402
from quickdraft.models.lm import load_model  # noqa: E402
from quickdraft.models.placement import resolve_placement  # noqa: E402


def passes(lm, prompt: torch.Tensor, nine: torch.Tensor) -> list[torch.Tensor]:
    lm.reset(prompt.numel() + 16)
    return [lm.extend(x, logits="all").clone() for x in (prompt, nine, nine[:1])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev")
    parser.add_argument("models", nargs="*", default=[str(ROOT / "quickdraft/assets/models/qd-stdlib-target"),
                                                      "smollm2-135m"])
    parser.add_argument("--quantize", default=None, choices=["int8", "int4"])
    args = parser.parse_args()
    ours, theirs = cpu_kernels.library(), step_ab.kernels_at(args.rev)
    for model in args.models:
        try:
            lm = load_model(model, placement=resolve_placement("cpu", None, args.quantize))
        except Exception as error:  # noqa: BLE001 - a model not installed here is skipped, said in a line
            print(f"{model}: skipped ({error})")
            continue
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, lm.vocab_size, (300,), generator=gen)
        nine = torch.randint(0, lm.vocab_size, (9,), generator=gen)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            step_ab.use_library(theirs)
            old = passes(lm, prompt, nine)
            step_ab.use_library(ours)
            new = passes(lm, prompt, nine)
            equal = [torch.equal(a, b) for a, b in zip(old, new)]
            line = f"{Path(model).name} ({args.quantize or 'as loaded'}), {threads} thread(s): equal {equal}"
            if not all(equal):
                diff = (old[0] - new[0]).abs()
                agree = float((old[0].argmax(-1) == new[0].argmax(-1)).float().mean())
                line += (f"; prefill max |diff| {float(diff.max()):.3g}, median {float(diff.median()):.3g}, "
                         f"argmax agrees at {agree:.1%} of positions")
            print(line, flush=True)


if __name__ == "__main__":
    main()
