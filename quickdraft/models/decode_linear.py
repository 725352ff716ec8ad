"""Linear layers laid out for decoding on CPU: one-row steps and few-row verify passes.

Decoding reads every weight once per step, so a step is bound by memory, and a speculative
verify pass of k+1 rows should cost little more than one row. PyTorch's default CPU linear
(MKL sgemm) falls short of that on small row counts: a 9-row product of the embedded
target's weights costs about twice a one-row product, and on AMD CPUs MKL is known to
take slower code paths than on Intel.

``DecodeLinear`` multiplies with our own AVX2 float32 kernel where it compiles
(``cpu_kernels.f32_matmul``, the same C file as the int8/int4 products): each row is
rounded the same way whatever the row count, by construction, so a verify row equals a
plain step and a batch row's products do not depend on its neighbours; and a block whose
linears all run on it is one C call (``cpu_kernels.block``). Measured on a 2-core AVX2
EPYC against oneDNN: one row 1.4-1.9x faster, nine rows 1.07-1.2x slower, the embedded
target's plain step 5.6 -> 2.9 ms with the one-call blocks (docs/step_cost.md). A weight
whose every value is a bfloat16 (or float16) number, as a bfloat16 (float16) checkpoint
computed in float32 has, is kept so (``kind``) and widened in the kernel, exactly: the same
results from half the bytes (the embedded target's passes 0.68-0.76x the time at 1-9
tokens).
Elsewhere (no compiler, or an input width not a multiple of 32) it holds the weight in
oneDNN's blocked layout, reordered once at load (a one-row product about half MKL's time,
nine rows ~1.2x one row); oneDNN rounds a row alone differently from the same row among
others at some widths (``rows_are_invariant``, checked per width), which are then
multiplied one row at a time. Inference only: no gradients.

A draft model decoding one sequence needs no such invariance (its numerics never change
what the target accepts as greedy output, and sampled output stays exact whatever ``q``
is): inside :func:`row_dependent_rounding`, one-row products of small weights take MKL's
kernel, which skips oneDNN's per-call overhead (measured: 7-17 us instead of 18-31 us for
the embedded draft's 0.07-0.2M-element weights; no gain from about 0.4M elements up).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import torch
from torch import nn

from . import cpu_kernels
from .quant_linear import WeightOnlyLinear


def onednn_linear_available() -> bool:
    """Whether this PyTorch build has oneDNN's packed float32 linear (x86 CPU builds)."""
    ops = ("_linear_pointwise", "_reorder_linear_weight")
    return torch.backends.mkldnn.is_available() and all(hasattr(torch.ops.mkldnn, op) for op in ops)


#: Weights up to this many elements keep a transposed copy for one-row MKL products.
SMALL_WEIGHT_ELEMENTS = 400_000

_rounding = threading.local()


@contextlib.contextmanager
def row_dependent_rounding() -> Iterator[None]:
    """Within (this thread): one-row products of small weights take the fastest kernel,
    whose rounding differs from a multi-row product's. Only for a model whose results
    need not match across row counts: a draft model decoding one sequence, never a
    target, an early-exit draft (it writes the target's cache) or a batched row."""
    before = getattr(_rounding, "free", False)
    _rounding.free = True
    try:
        yield
    finally:
        _rounding.free = before


#: Our kernel for each ``DecodeLinear.kind`` (the format of ``exact_weight``).
PRODUCTS = {"f32": cpu_kernels.f32_matmul, "bf16": cpu_kernels.half_matmul, "f16": cpu_kernels.half_matmul,
            "bf16dp": cpu_kernels.bf16_products}


class PackedWeightsError(ValueError):
    """A layer's weights exist only in oneDNN's opaque packed form (no copy to read rows from)."""


class DecodeLinear(nn.Module):
    """Drop-in inference replacement for ``nn.Linear`` on CPU (see the module docstring)."""

    def __init__(self, linear: nn.Linear, bf16_products: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        small = weight.numel() <= SMALL_WEIGHT_ELEMENTS
        self.single_row_weight = weight.t().contiguous() if small else None
        # Our own float32 kernel where it compiles (cpu_kernels): row-invariant by
        # construction, ~1.4-1.9x faster than oneDNN for one row, ~1.1-1.2x slower for nine,
        # and it lets a whole block be one C call (cpu_kernels.block). Else oneDNN, whose
        # rounding of a row alone differs from the same row among others for some input
        # widths (every K > 1024 on an AVX2 EPYC): there one row at a time, so that a verify
        # pass never disagrees with a plain step at a near-tie.
        self.exact_weight, self.packed, self.row_by_row = None, None, False
        self.kind = "f32"  # exact_weight's format for our kernels (PRODUCTS): "f32", "bf16", "f16" or "bf16dp"
        if cpu_kernels.library() is not None and self.in_features % 32 == 0:
            self.exact_weight = weight.float().contiguous()
            # Weights that are bfloat16 (or float16) values, as a bf16 (fp16) checkpoint's
            # are once loaded in float32, are kept in half the bytes: the kernel widens each
            # exactly, so the results are the same bit for bit, and a step, which streams
            # every weight, reads half as much.
            for kind, dtype in (("bf16", torch.bfloat16), ("f16", torch.float16)):
                narrow = self.exact_weight.to(dtype)
                if torch.equal(narrow.float(), self.exact_weight):
                    self.exact_weight, self.kind = narrow, kind
                    break
            # A bfloat16 model on the CPU (loading.build_native): bfloat16 inputs too.
            if bf16_products and self.kind == "bf16" and cpu_kernels.bf16_products_supported():
                self.kind = "bf16dp"
        else:
            # An opaque oneDNN tensor, not a parameter: state_dict and .to() never see it.
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
            self.row_by_row = not rows_are_invariant(self.in_features, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.single_row_weight is not None and x.numel() == self.in_features
                and getattr(_rounding, "free", False)):
            y = x @ self.single_row_weight
            return y if self.bias is None else y + self.bias
        if self.exact_weight is not None and torch.compiler.is_compiling():
            # Dynamo cannot trace a ctypes call; a traced CPU step is never what decodes
            # (the static step stays eager on the CPU), it only has to be one graph.
            return torch.nn.functional.linear(x, self.exact_weight.float(), self.bias)
        if self.exact_weight is not None:
            y = PRODUCTS[self.kind](x.reshape(-1, self.in_features), self.exact_weight)
            y = y.view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        if self.row_by_row and x.numel() > self.in_features:
            rows = x.reshape(-1, self.in_features)
            y = torch.cat([self._onednn(rows[i : i + 1]) for i in range(rows.shape[0])])
            return y.view(*x.shape[:-1], self.out_features)
        return self._onednn(x)

    def dequantized(self) -> torch.Tensor:
        """The float32 weights it multiplies by (as the quantized layers' method of this name
        gives theirs), where it keeps them: our kernels' copy, or a small weight's; a
        PackedWeightsError for a weight only oneDNN's packed form holds."""
        if self.exact_weight is not None:
            return self.exact_weight.float()
        if self.single_row_weight is not None:
            return self.single_row_weight.t().float()
        raise PackedWeightsError("this layer's weights are packed by oneDNN (no C compiler for our kernels)")

    def kernel_spec(self) -> cpu_kernels.LinearSpec | None:
        """This layer for ``cpu_kernels.block``: only where it multiplies with our kernel."""
        if self.exact_weight is None:
            return None
        return cpu_kernels.linear_spec(self.kind, self.out_features, self.in_features, self.exact_weight, bias=self.bias)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


@functools.cache
def rows_are_invariant(in_features: int = 64, out_features: int = 200, max_rows: int = 80) -> bool:
    """Whether oneDNN's packed product rounds each row alike for every row count up to
    ``max_rows`` on this machine (what makes a batch row's products independent of the
    other rows). Measured once per process and shape; ``DecodeLinear`` asks it per input
    width and mends the widths where it fails."""
    if not onednn_linear_available():
        return False
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(max_rows, in_features, generator=gen)
    with torch.inference_mode():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)

        def product(rows: torch.Tensor) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")

        alone = torch.cat([product(x[i : i + 1]) for i in range(max_rows)])
        return all(torch.equal(product(x[:rows]), alone[:rows]) for rows in range(1, max_rows + 1))


#: Row counts MKL's float32 product (plain ``nn.Linear``, the fallback without oneDNN)
#: computes with the same per-row arithmetic as any large row count (measured: 4, 8 and
#: every count from 12 up; 1-3, 5-7 and 9-11 rows take other kernels whose rounding
#: differs). tests/test_batch_engine.py checks it on this machine.
CANONICAL_MIN_ROWS = 12


def canonical_rows(rows: int, invariant: bool = False) -> int:
    """The smallest row count >= ``rows`` whose products round every row exactly as any
    other canonical count does: padding a batch's rows to it makes a row's result
    independent of how many rows share the product (batch invariance). ``invariant``: the
    products are ``DecodeLinear``'s on a machine where every count rounds alike."""
    if invariant:
        return rows
    if rows <= 4:
        return 4
    if rows <= 8:
        return 8
    return max(rows, CANONICAL_MIN_ROWS)


def use_decode_linears(model: nn.Module) -> bool:
    """Swap every float32 CPU ``nn.Linear`` in ``model`` for a ``DecodeLinear``, in place.

    Returns whether the model now has CPU decode kernels: decode linears (none on other
    devices or dtypes, nor on builds without oneDNN; swapping twice is harmless) or
    quantized linears (``quant_linear``), which are row-invariant too. Tied weights get
    their own packed copy; the embedding keeps its own. A model marked ``bf16_products``
    (``loading.build_native``) multiplies bfloat16-rounded inputs.
    """
    if not onednn_linear_available():
        return False
    bf16 = getattr(model, "bf16_products", False)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype == torch.float32:
                setattr(parent, name, DecodeLinear(child, bf16))
    return any(isinstance(m, (DecodeLinear, WeightOnlyLinear)) for m in model.modules())


def invariant_rows(model: nn.Module) -> bool:
    """Whether every row count rounds each row of ``model``'s products alike (decode
    linears on a machine where ``rows_are_invariant``): no canonical padding needed."""
    return isinstance(getattr(model, "lm_head", None), (DecodeLinear, WeightOnlyLinear)) and rows_are_invariant()
