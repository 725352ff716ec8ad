"""Linear layers laid out for decoding on CPU: one-row steps and few-row verify passes.

PyTorch's CPU linear (MKL sgemm) handles one row and hundreds of rows well, but a product
with a handful of rows -- a speculative verify pass of k+1 tokens -- costs two to three
times a one-row product, because MKL repacks the whole weight on every call. Decoding
reads every weight once per step, so that repacking is most of a verify pass.

``DecodeLinear`` keeps the weight transposed (``x @ W^T`` stored contiguous is the
faster one-row layout on this kind of CPU) and, for the one row count a decode loop
verifies with, an MKL-prepacked copy made by ``prepack(rows)``. Results equal
``nn.Linear`` up to float32 rounding order. Inference only: no gradients.
"""

from __future__ import annotations

import torch
from torch import nn

# The prepacked copy doubles the weight memory; above this size it is not worth it.
MAX_PACKED_BYTES = 2 << 30


def mkl_prepack_available() -> bool:
    """Whether this PyTorch build has MKL's prepacked float32 linear (x86 CPU builds)."""
    ops = ("_mkl_linear", "_mkl_reorder_linear_weight")
    return bool(torch._C.has_mkl) and all(hasattr(torch.ops.mkl, op) for op in ops)


class DecodeLinear(nn.Module):
    """Drop-in inference replacement for ``nn.Linear`` on CPU (see the module docstring)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.packed: torch.Tensor | None = None
        self.packed_rows = 0

    def prepack(self, rows: int) -> None:
        """Prepare the fast kernel for products of exactly ``rows`` rows (0 or 1: none)."""
        if rows == self.packed_rows:
            return
        self.packed, self.packed_rows = None, 0
        if rows > 1:
            weight = self.weight_t.t()
            self.packed, self.packed_rows = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows), rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows == self.packed_rows:
            return torch.ops.mkl._mkl_linear(x, self.packed, self.weight_t.t(), self.bias, rows)
        out = x @ self.weight_t
        return out if self.bias is None else out + self.bias


#: Row counts MKL's float32 product computes with the same per-row arithmetic as any large
#: row count (measured: 4, 8 and every count from 12 up; 1-3, 5-7 and 9-11 rows take other
#: kernels whose rounding differs). tests/test_batch_engine.py checks it on this machine.
CANONICAL_MIN_ROWS = 12


def canonical_rows(rows: int) -> int:
    """The smallest row count >= ``rows`` whose products round every row exactly as any
    other canonical count does: padding a batch's rows to it makes a row's result
    independent of how many rows share the product (batch invariance)."""
    if rows <= 4:
        return 4
    if rows <= 8:
        return 8
    return max(rows, CANONICAL_MIN_ROWS)


def use_decode_linears(model: nn.Module) -> bool:
    """Swap every float32 CPU ``nn.Linear`` in ``model`` for a ``DecodeLinear``, in place.

    Returns whether the model now has decode linears (none on other devices or dtypes,
    nor on builds without MKL; swapping twice is harmless). Tied weights get their own
    transposed copy; the embedding keeps its own.
    """
    if not mkl_prepack_available():
        return False
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype == torch.float32:
                setattr(parent, name, DecodeLinear(child))
    return any(isinstance(m, DecodeLinear) for m in model.modules())


def prepack_decode_linears(model: nn.Module, rows: int) -> None:
    """Prepack every ``DecodeLinear`` of ``model`` for ``rows``-row products, when the
    packed copies fit in ``MAX_PACKED_BYTES``."""
    layers = [m for m in model.modules() if isinstance(m, DecodeLinear)]
    size = sum(m.weight_t.numel() * m.weight_t.element_size() for m in layers)
    for layer in layers:
        layer.prepack(rows if size <= MAX_PACKED_BYTES else 0)
