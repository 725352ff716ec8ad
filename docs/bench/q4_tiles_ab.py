"""SmolLM2's int4 passes, pass by pass in one process: the int4 layout and kernels of commit
REV (GGUF's own blocks, float32 activations: before session 32) vs this tree's (tiles of 16
weight rows, 8-bit activations), alternating:

    python docs/bench/q4_tiles_ab.py --rev acbd82d [--widths 1,2,3,5,9] [--context 128]

Prints the median wall time of a pass of each width (tokens) after a context, each way, and
their ratio (tree / REV). The two ways round differently (8-bit activations): only their
speed is compared here; tests/test_quant_linear.py checks the new rule.
"""

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))
from step_ab import kernels_at, use_library  # noqa: E402

from quickdraft.models import cpu_kernels  # noqa: E402
from quickdraft.models.lm import load_model  # noqa: E402
from quickdraft.models.quant_linear import Int4Linear  # noqa: E402


def gguf_layout(layer: Int4Linear) -> Int4Linear:
    """A twin of ``layer`` in the layout older kernels read: nibbles in GGUF's block order
    (byte j of a group: q[j] low, q[j + 16] high), [out, groups] scales and zeros."""
    n, groups = layer.out_features, layer.in_features // 32
    scale, offset = (t.transpose(1, 2).reshape(-1, groups)[:n] for t in (layer.scale, layer.offset))
    weight = cpu_kernels.unpack_q4(layer.tiles, layer.scale, layer.offset, n).view(n, groups, 32)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = ((weight - offset[..., None]) / safe[..., None]).round().clamp(0, 15).to(torch.uint8)
    halves = q.view(n, groups, 2, 16)
    twin = copy.copy(layer)
    twin.tiles = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, -1).contiguous()
    twin.scale, twin.offset = scale.contiguous(), (offset + 8 * scale).contiguous()  # zero = offset + 8 scale
    return twin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", required=True, help="a commit before the int4 tiles (e.g. acbd82d)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--widths", default="1,2,3,5,9")
    parser.add_argument("--rounds", type=int, default=120)
    parser.add_argument("--context", type=int, default=128)
    args = parser.parse_args()
    ours, theirs = cpu_kernels.library(), kernels_at(args.rev)
    lm = load_model(args.model)
    places = [(parent, name, child) for parent in lm.model.modules() for name, child in parent.named_children()
              if isinstance(child, Int4Linear)]
    if not places:
        raise SystemExit(f"{args.model} has no int4 layers here (needs our kernels and a Q4 file)")
    old = [gguf_layout(child) for _, _, child in places]

    def use(modules, lib):
        use_library(lib)
        for (parent, name, _), module in zip(places, modules, strict=True):
            setattr(parent, name, module)

    ways = [(args.rev, lambda: use(old, theirs)), ("tiles", lambda: use([c for _, _, c in places], ours))]
    gen = torch.Generator().manual_seed(0)
    widths = [int(w) for w in args.widths.split(",")]
    lm.reset(args.context + max(widths))
    lm.extend(torch.randint(0, lm.vocab_size, (args.context,), generator=gen), logits="none")
    for width in widths:
        tokens = torch.randint(0, lm.vocab_size, (width,), generator=gen)
        times: dict[str, list[float]] = {name: [] for name, _ in ways}
        for i in range(args.rounds):
            for name, switch in ways if i % 2 else ways[::-1]:
                switch()
                lm.crop(args.context)
                start = time.perf_counter()
                lm.extend(tokens, logits="all")
                if i >= args.rounds // 6:  # the first rounds warm up
                    times[name].append(time.perf_counter() - start)
        a, b = (statistics.median(times[name]) * 1e3 for name, _ in ways)
        print(f"width {width}: {args.rev} {a:.2f} ms, tiles {b:.2f} ms, tiles / {args.rev} {b / a:.3f}", flush=True)
    use([c for _, _, c in places], ours)


if __name__ == "__main__":
    main()
