"""Two ways of running the same decode step, interleaved pass by pass in one process (this
host's speed drifts between processes):

    python scripts/step_ab.py block [MODEL]   # one C call per block vs the per-op fused path
    python scripts/step_ab.py stack [MODEL]   # one C call for all blocks vs one per block
    python scripts/step_ab.py isa [MODEL]     # AVX-512 vs AVX2 int4 products
    python scripts/step_ab.py build [MODEL] --rev REV  # the kernels as of commit REV vs this tree's
                                                       # (float32 weights both ways, or --quantize's
                                                       # from session 32 on, int8 / int4 in REV's
                                                       # layout where it predates session 42's blocks;
                                                       # before 32: docs/bench/tiles_ab.py)
    python scripts/step_ab.py weights [MODEL]  # bf16/fp16-valued weights stored as float32 vs 16-bit
    python scripts/step_ab.py products [MODEL]  # bf16 weights times float32 inputs vs bf16 products
                                                # (--dtype bfloat16 on an AVX512_BF16 CPU)
    # MODEL: default smollm2-135m (make real-model); --widths 1,3,6,9; --context 128
    # a prefill: --context 0 --widths 256,1024 --logits last

Prints the median wall time of a pass of each width after a 128-token context, each way,
and their ratio (second / first). Both ways give the same logits bit for bit
(tests/test_layer_ops.py, tests/test_quant_linear.py); only their speed differs, except
``products``, whose second way rounds the products' inputs to bfloat16 (what --dtype
bfloat16 computes; tests/test_bf16_products.py).
"""

import argparse
import copy
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's quickdraft
from quickdraft.models import cpu_kernels, transformer  # noqa: E402
from quickdraft.models.decode_linear import DecodeLinear  # noqa: E402
from quickdraft.models.lm import load_model  # noqa: E402
from quickdraft.models.placement import resolve_placement  # noqa: E402
from quickdraft.models.quant_linear import Int4Linear, Int8Linear  # noqa: E402

BLOCK_SPECS = transformer.Block.kernel_specs
BLOCK_STACK = transformer.Transformer.block_stack


def per_op(self):  # Block.kernel_specs standing in: "no block call", so the per-op path runs
    return None


def use_block(on: bool) -> None:
    transformer.Block.kernel_specs = BLOCK_SPECS if on else per_op


def use_stack(on: bool) -> None:  # off: "no stack", so each block is its own call
    transformer.Transformer.block_stack = BLOCK_STACK if on else (lambda self, start, stop: None)


#: comparison -> (name of each way, function that switches to it)
WAYS: dict[str, list[tuple[str, Callable[[], None]]]] = {
    "block": [("per-op", lambda: (use_stack(False), use_block(False))),
              ("block", lambda: (use_stack(False), use_block(True)))],
    "stack": [("per-block", lambda: use_stack(False)), ("stack", lambda: use_stack(True))],
    "isa": [("avx2", lambda: cpu_kernels.kernel_isa("avx2")), ("avx512", lambda: cpu_kernels.kernel_isa("avx512"))],
}


def kernels_at(rev: str):
    """The kernels compiled from commit ``rev``'s sources (set up as :func:`cpu_kernels.library` does)."""
    root = Path(tempfile.mkdtemp(prefix="kernels-"))
    sources = []
    for source in (*cpu_kernels.SOURCES, *cpu_kernels.HEADERS):
        shown = subprocess.run(["git", "show", f"{rev}:quickdraft/models/kernels/{source.name}"],
                               capture_output=True, cwd=Path(__file__).resolve().parents[1])
        if shown.returncode == 0:  # a file added since is not part of that build
            (root / source.name).write_bytes(shown.stdout)
            sources += [root / source.name] if source in cpu_kernels.SOURCES else []
    built = root / "kernels.so"
    subprocess.run([cpu_kernels._compiler(), *cpu_kernels.FLAGS, *map(str, sources), "-o", str(built), "-lm"],
                   check=True)
    build, cdll = cpu_kernels._build, cpu_kernels.ctypes.CDLL
    cpu_kernels._build = lambda compiler: built
    cpu_kernels.ctypes.CDLL = lambda path: Older(cdll(path))
    try:
        return cpu_kernels.library.__wrapped__()
    finally:
        cpu_kernels._build, cpu_kernels.ctypes.CDLL = build, cdll


class Older:
    """An older build's library: the functions it lacks (added since) read as stand-ins
    that take their set-up and are never called (``build`` keeps 16-bit weights wide)."""

    def __init__(self, lib) -> None:
        self._lib = lib

    def __getattr__(self, name: str):
        try:
            return getattr(self._lib, name)
        except AttributeError:
            stand_in = SimpleNamespace()
            setattr(self, name, stand_in)
            return stand_in


def put(places: list, modules: list) -> None:
    """Each ``(parent, name, _)`` of ``places`` gets the module of ``modules`` at its index."""
    for (parent, name, _), module in zip(places, modules, strict=True):
        setattr(parent, name, module)


def use_library(lib) -> None:
    cpu_kernels.library = lambda: lib


def layout_at(rev: str, kind: str) -> str:
    """How commit ``rev``'s ``kind`` (``q8`` / ``q4``) kernel reads its weights: ``arrays``
    (weights, scales and offsets or shifts in three arrays: before session 42),
    ``shifts`` (int8 blocks with int32 shifts: 7b0bd7c) or ``tree`` (this tree's blocks)."""
    header = subprocess.run(["git", "show", f"{rev}:quickdraft/models/kernels/{kind}a8.h"], capture_output=True,
                            text=True, cwd=Path(__file__).resolve().parents[1]).stdout
    if f"{kind.upper()}_BLOCK_BYTES" not in header:
        return "arrays"
    return "shifts" if "Q8_SIDE_BYTES" in header else "tree"


class ArraysSpec(ctypes.Structure):
    """``QdLinear`` before session 42's int8 blocks: pointers to a linear's scales and
    offsets (shifts) beside its weights."""

    _fields_ = [("kind", ctypes.c_int64), ("in_features", ctypes.c_int64), ("out_features", ctypes.c_int64),
                ("q", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class OlderLayout(torch.nn.Module):
    """An int8 or int4 layer in an older build's layout (:func:`layout_at`), for its kernels."""

    def __init__(self, layer: Int4Linear | Int8Linear, lib, layout: str, struct) -> None:
        super().__init__()
        self.layer, self.struct, int4 = layer, struct, isinstance(layer, Int4Linear)
        p, i64 = ctypes.c_void_p, ctypes.c_int64  # the product as the build declares it
        product = lib.qd_q4_matmul if int4 else lib.qd_q8_matmul
        self.arrays = layout == "arrays"  # the product takes the scale and offset (shift) arrays
        args = (p, i64, i64, p, p, p, i64, p, ctypes.c_int) if self.arrays else (p, i64, i64, p, i64, p, ctypes.c_int)
        self.product = ctypes.CFUNCTYPE(None, *args)(ctypes.cast(product, ctypes.c_void_p).value)
        self.scale = self.zero = None
        if layout == "tree":
            self.weights = layer.tiles
        elif int4:  # arrays: the nibbles; float16 scales and offsets as float32 arrays
            cut = cpu_kernels.Q4_NIBBLE_BYTES
            side = layer.tiles[..., cut:].contiguous().view(torch.float16).float()
            self.weights = layer.tiles[..., :cut].contiguous()
            self.scale, self.zero = side[..., : cpu_kernels.Q_TILE].contiguous(), side[..., cpu_kernels.Q_TILE :].contiguous()
        else:  # int8 q (not q + 128), float32 scales and int32 shifts (128 * the group's weight sum)
            cut = cpu_kernels.Q8_WEIGHT_BYTES
            q = (layer.tiles[..., :cut] ^ 0x80).view(torch.int8)
            shift = 128 * q.view(*q.shape[:2], 8, cpu_kernels.Q_TILE, 4).sum((2, 4), dtype=torch.int32)
            scale = layer.tiles[..., cut:].contiguous()
            if layout == "shifts":  # one 640-byte block
                self.weights = torch.cat([q.view(torch.uint8), scale, shift.view(torch.uint8)], -1).contiguous()
            else:
                self.weights, self.scale, self.zero = q.contiguous(), scale.view(torch.float32), shift.contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # a head outside the blocks' C calls
        flat = x.reshape(-1, self.layer.in_features).contiguous()
        y = torch.empty(flat.shape[0], self.layer.out_features)
        arrays = (address(self.scale), address(self.zero)) if self.arrays else ()
        self.product(flat.data_ptr(), flat.shape[0], flat.shape[1], self.weights.data_ptr(), *arrays,
                     self.layer.out_features, y.data_ptr(), torch.get_num_threads())
        y = y if self.layer.bias is None else y + self.layer.bias
        return y.view(*x.shape[:-1], self.layer.out_features)

    def kernel_spec(self):
        kind = cpu_kernels.LINEAR_KINDS["q4" if isinstance(self.layer, Int4Linear) else "q8"]
        arrays = (address(self.scale), address(self.zero)) if self.struct is ArraysSpec else ()
        return self.struct(kind, self.layer.in_features, self.layer.out_features, self.weights.data_ptr(), *arrays,
                           address(self.layer.bias))


def address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def layout_ways(model: torch.nn.Module, theirs, ours, rev: str) -> list[tuple[str, Callable[[], None]]] | None:
    """``build``'s two ways with every int8 / int4 layer of ``model`` in REV's layout for
    REV's kernels; None where REV reads this tree's."""
    layouts = {Int4Linear: layout_at(rev, "q4"), Int8Linear: layout_at(rev, "q8")}
    if set(layouts.values()) == {"tree"}:
        return None
    places = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
              if isinstance(child, (Int4Linear, Int8Linear)) and child.native]
    tree_struct = cpu_kernels.LinearSpec
    struct = ArraysSpec if layouts[Int8Linear] == "arrays" else tree_struct
    old = [OlderLayout(child, theirs, layouts[type(child)], struct) for _, _, child in places]

    def use(modules, spec_struct):
        cpu_kernels.LinearSpec = spec_struct  # what BlockStack builds its array of
        put(places, modules)

    return [(rev, lambda: (use_library(theirs), use(old, struct))),
            ("tree", lambda: (use_library(ours), use([c for _, _, c in places], tree_struct)))]


def weight_ways(model: torch.nn.Module) -> list[tuple[str, Callable[[], None]]]:
    """Switch every 16-bit-stored decode linear of ``model`` to a float32 copy and back
    (other modules swapped in, so the cached block specs are rebuilt)."""
    places = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
              if isinstance(child, DecodeLinear) and child.kind != "f32"]
    wide = []
    for _, _, child in places:
        twin = copy.copy(child)
        twin.exact_weight, twin.kind = child.exact_weight.float(), "f32"
        wide.append(twin)

    return [("float32", lambda: put(places, wide)), ("16-bit", lambda: put(places, [c for _, _, c in places]))]


def products_ways(model: torch.nn.Module) -> list[tuple[str, Callable[[], None]]]:
    """Switch every bfloat16-stored decode linear of ``model`` between float32 inputs (the
    float32 model's kernel) and bfloat16 products (``--dtype bfloat16``'s), same weights."""
    places = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
              if isinstance(child, DecodeLinear) and child.kind == "bf16"]
    if not places or not cpu_kernels.bf16_products_supported():
        raise SystemExit("products: needs bfloat16-valued weights (the embedded models) and AVX512_BF16")
    narrow = []
    for _, _, child in places:
        twin = copy.copy(child)
        twin.kind = "bf16dp"
        narrow.append(twin)

    return [("float32 inputs", lambda: put(places, [c for _, _, c in places])), ("bf16 products", lambda: put(places, narrow))]


def check(lm, ways: list[tuple[str, Callable[[], None]]], context: int) -> None:
    """Exit unless both ways give the same logits bit for bit on one pass of 3 tokens."""
    tokens = torch.randint(0, lm.vocab_size, (context + 3,), generator=torch.Generator().manual_seed(1))
    logits = []
    for _, switch in ways:
        switch()
        lm.reset(context + 3)
        lm.extend(tokens[:context], logits="none")
        logits.append(lm.extend(tokens[context:], logits="all").clone())
    if not torch.equal(*logits):
        raise SystemExit(f"the two ways' logits differ (max {(logits[0] - logits[1]).abs().max().item():.3g}): "
                         "the older layout is not what that build reads")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("compare", choices=sorted([*WAYS, "build", "weights", "products"]))
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    parser.add_argument("--widths", default="1,3,6,9")
    parser.add_argument("--rounds", type=int, default=240)
    parser.add_argument("--rev", default="HEAD", help="build: the commit whose kernels run first")
    parser.add_argument("--context", type=int, default=128, help="tokens in the cache before each pass")
    parser.add_argument("--logits", default="all", choices=["all", "last"],
                        help="logits of every token of a pass (a verify pass) or of the last (a prefill)")
    parser.add_argument("--quantize", default=None, choices=["int8", "int4"],
                        help="the model's block linears in this format (build: both builds must read it)")
    args = parser.parse_args()
    if args.compare == "build":
        ours, theirs = cpu_kernels.library(), kernels_at(args.rev)
        WAYS["build"] = [(args.rev, lambda: use_library(theirs)), ("tree", lambda: use_library(ours))]
    lm = load_model(args.model, placement=resolve_placement("cpu", None, args.quantize))
    if args.compare == "weights":
        WAYS["weights"] = weight_ways(lm.model)
    elif args.compare == "products":
        WAYS["products"] = products_ways(lm.model)
    elif args.compare == "build" and not args.quantize:  # float32 weights both ways: an older build may not take 16-bit ones
        dict(weight_ways(lm.model))["float32"]()
    if args.compare == "build":
        WAYS["build"] = layout_ways(lm.model, theirs, ours, args.rev) or WAYS["build"]
    ways = WAYS[args.compare]
    if args.compare in ("build", "isa", "weights"):  # the same logits both ways, or the timing compares nothing
        check(lm, ways, args.context)
    gen = torch.Generator().manual_seed(0)
    context = args.context
    lm.reset(context + max(map(int, args.widths.split(","))))
    if context:
        lm.extend(torch.randint(0, lm.vocab_size, (context,), generator=gen), logits="none")
    try:
        for width in map(int, args.widths.split(",")):
            tokens = torch.randint(0, lm.vocab_size, (width,), generator=gen)
            times: dict[str, list[float]] = {name: [] for name, _ in ways}
            for i in range(args.rounds):
                for name, switch in ways if i % 2 else ways[::-1]:
                    switch()
                    lm.crop(context)
                    start = time.perf_counter()
                    lm.extend(tokens, logits=args.logits)
                    if i >= args.rounds // 6:  # the first rounds warm up
                        times[name].append(time.perf_counter() - start)
            (a_name, _), (b_name, _) = ways
            a, b = (statistics.median(times[name]) * 1e3 for name in (a_name, b_name))
            print(f"width {width}: {a_name} {a:.2f} ms, {b_name} {b:.2f} ms, {b_name} / {a_name} {b / a:.3f}",
                  flush=True)
    finally:
        use_block(True)
        use_stack(True)
        cpu_kernels.kernel_isa("avx512")


if __name__ == "__main__":
    main()
