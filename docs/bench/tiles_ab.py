"""A quantized model's passes, pass by pass in one process: the int8 / int4 layouts and
kernels of commit REV (one weight row after another; int4 with float32 activations: before
session 32) vs this tree's (tiles of 16 weight rows, 8-bit activations), alternating:

    python docs/bench/tiles_ab.py --rev acbd82d [--model smollm2-135m] [--widths 1,2,3,5,9]

(It runs in a checkout from session 32 to 8a7d4f2: its twins take the tiles and separate
scale arrays of that time. Session 42's blocks are compared with those by
``scripts/step_ab.py build --rev 8a7d4f2``.)

Prints the median wall time of a pass of each width (tokens) after a context, each way, and
their ratio (tree / REV). The two ways round differently (int4: 8-bit activations; int8: the
order of the float sums): only their speed is compared here; tests/test_quant_linear.py
checks the new rules.
"""

import argparse
import copy
import ctypes
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
from quickdraft.models.quant_linear import Int4Linear, Int8Linear  # noqa: E402


def int4_rows(layer: Int4Linear) -> Int4Linear:
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


def int8_rows(layer: Int8Linear, old_lib) -> Int8Linear:
    """A twin of ``layer`` for older kernels: int8 [out, in] and [out, groups] scales, its
    product called with the older signature (no shift)."""
    q, scale = cpu_kernels.unpack_q8(layer.tiles, layer.scale, layer.out_features)
    twin = copy.copy(layer)
    twin.tiles, twin.scale, twin.shift = q.contiguous(), scale.contiguous(), None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    address = ctypes.cast(old_lib.qd_q8_matmul, ctypes.c_void_p).value
    product = ctypes.CFUNCTYPE(None, p, i64, i64, p, p, i64, p, ctypes.c_int)(address)

    def mm(x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        y = torch.empty(x.shape[0], layer.out_features)
        product(x.data_ptr(), x.shape[0], x.shape[1], twin.tiles.data_ptr(), twin.scale.data_ptr(),
                layer.out_features, y.data_ptr(), torch.get_num_threads())
        return y

    twin._mm = mm
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
              if isinstance(child, (Int4Linear, Int8Linear)) and child.native]
    if not places:
        raise SystemExit(f"{args.model} has no int8 / int4 layers on our kernels here")
    old = [int4_rows(c) if isinstance(c, Int4Linear) else int8_rows(c, theirs) for _, _, c in places]

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
