"""Quantized linear layers for CPU decoding: int4 in groups, int8 in groups or per channel.

``Int4Linear`` keeps 4-bit weights in groups of 32 along the input dimension, each group
with a scale and zero, ``w = (q - 8) * scale + zero`` for ``q`` in 0..15 (the
convention of PyTorch's CPU kernel ``aten._weight_int4pack_mm_for_cpu``). GGUF's 32-value
blocks map onto it exactly:

* Q4_1 (``w = d * q + m``): ``scale = d``, ``zero = m + 8 d``;
* Q4_0 (``w = d * (q - 8)``): ``scale = d``, ``zero = 0``.

(``tests/test_quant_linear.py`` checks both against the ``gguf`` package's dequantizer.)
A float32 checkpoint is quantized the Q4_1 way: each group's minimum and maximum. Our
kernels keep the scale and ``zero - 8 * scale`` (Q4_1's ``m``) in float16, as GGUF does.

On our kernels the nibbles are laid out in tiles of 16 output rows and the inputs are
quantized to 8 bits per group of 32, as llama.cpp runs Q4_0/Q4_1 (``cpu_kernels.q4_matmul``,
``kernels/q4a8.h``): a group's product is an exact integer sum, so a verify pass of several
rows costs far less than multiplying float32 inputs by dequantized weights
(docs/quantization.md).

``Int8Linear`` keeps int8 weights with a float32 scale per output channel (quantized
symmetrically from float32 weights) or per group of 32 inputs (GGUF's Q8_0, taken as it
is). On our kernels its inputs are quantized to 8 bits per group of 32 as well, as
llama.cpp runs Q8_0 weights (``cpu_kernels.q8_matmul``): each group's product is then an
exact integer sum, 1.2-1.6x faster than multiplying float32 activations by the
dequantized weights (docs/quantization.md), and still row-invariant. Without our kernels,
PyTorch's ``aten._weight_int8pack_mm`` multiplies float32 activations (per channel only).

Lossless speculative decoding needs each row's result to be independent of how many
rows share the product (a verify pass of k+1 rows against a plain step of one).
:func:`kernel_rows_are_invariant` checks that on this machine, once per kind; where it
fails, the layers multiply row by row (exact, slower).

Speed: PyTorch's int4/int8 kernels (torch 2.13) are 5-30x slower than the float32 product
they replace, on AVX2 and on the AVX-512 (Zen 4) host measured alike (1536x576 at one row:
int4 891 us, int8 557 us, float32 113 us; at nine rows 8-10 ms against 0.3 ms). So where
our own kernels can run (:mod:`.cpu_kernels`: small C files compiled once per machine),
both layers use them instead: a one-row product reads 1 (int8) or 0.56 (int4) bytes per
weight instead of 4. :func:`fast_kernels` says whether they run here (docs/quantization.md
has the figures).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from . import cpu_kernels

#: ``--quantize`` values: ``auto`` runs a GGUF file's Q4_0/Q4_1 linears in int4 where the
#: our kernels run (:func:`fast_kernels`), float32 otherwise; ``none`` dequantizes
#: everything to float32; ``int8`` / ``int4`` quantize every transformer-block linear.
QUANTIZE_CHOICES = ("auto", "none", "int8", "int4")
GROUP = 32  # int4 group size along the input dimension: GGUF's block size
INT4_ROW_MULTIPLE = 16  # PyTorch's int4 packer's requirement on the output dimension


def kernels_available() -> bool:
    """Whether this PyTorch build has the CPU int4 and int8 weight-only kernels."""
    ops = ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu", "_weight_int8pack_mm")
    return all(hasattr(torch.ops.aten, op) for op in ops)


def native_kernels() -> bool:
    """Whether our AVX2 kernels (:mod:`.cpu_kernels`) run here; the layers then use them."""
    return cpu_kernels.library() is not None


def fast_kernels() -> bool:
    """Whether quantized products are faster than float32 on this CPU: where our kernels
    run. PyTorch's own are slower than float32 even on AVX-512 (measured: see the module's
    docstring), so without ours ``--quantize auto`` keeps float32."""
    return native_kernels()


class WeightOnlyLinear(nn.Module):
    """What the int4 and int8 layers share: rows one at a time where the kernel would round
    a row by the row count (``row_by_row``), then the bias. Subclasses give ``_mm``."""

    in_features: int
    out_features: int
    row_by_row: bool
    bias: torch.Tensor | None

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad and torch.is_grad_enabled():  # the kernels have no backward
            raise RuntimeError("quantized linears are for inference; load the model with quantize='none' to train it")
        flat = x.reshape(-1, self.in_features)
        if self.row_by_row and flat.shape[0] > 1:
            y = torch.cat([self._mm(flat[i : i + 1]) for i in range(flat.shape[0])])
        else:
            y = self._mm(flat)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


class Int4Linear(WeightOnlyLinear):
    """``y = x @ W.T + b`` with ``W`` stored as 4-bit groups of 32 (see the module docstring)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 bias: torch.Tensor | None = None, row_by_row: bool | None = None) -> None:
        """``q``: ``[out, in]`` integers in 0..15; ``scale``, ``zero``: ``[out, in / 32]``,
        the weight being ``(q - 8) * scale + zero`` group by group. ``row_by_row``: multiply
        one row at a time (None: where the kernel is not row-invariant here)."""
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.native = native_kernels()
        if self.native:  # nibbles in tiles of 16 output rows, each group's block with its scales
            self.tiles = cpu_kernels.pack_q4(q, scale, zero)
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
            # The kernel's layout: [groups, out, 2] (scale, zero).
            self.scales_and_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().float()
        self.bias = None if bias is None else bias.detach().float().clone()
        self.row_by_row = not kernel_rows_are_invariant("int4") if row_by_row is None else row_by_row

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    row_by_row: bool | None = None) -> Int4Linear:
        """Quantize a float weight the Q4_1 way: per group of 32, 16 levels from min to max,
        the scale and minimum rounded to float16 first (as llama.cpp's Q4_1 stores them, and
        as our kernels read them: ``cpu_kernels.pack_q4``)."""
        out_features, in_features = weight.shape
        groups = weight.detach().float().reshape(out_features, in_features // GROUP, GROUP)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).half().float()
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # a constant group: q = 0
        low = low.half().float()
        if not (scale.isfinite().all() and low.isfinite().all()):
            raise ValueError("int4 keeps each group's scale and minimum in float16: this weight has values beyond "
                             "its range (|w| > 65504); quantize it to int8 instead")
        q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15)
        return cls(q.reshape(out_features, in_features), scale, low + 8 * scale, bias, row_by_row)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight these layers multiply by (on our kernels ``q * scale + offset``,
        times the 8-bit activations; else the identity matrix through PyTorch's kernel)."""
        if self.native:
            return cpu_kernels.unpack_q4(self.tiles, self.out_features)
        return self._mm(torch.eye(self.in_features)).t()

    def kernel_spec(self) -> cpu_kernels.LinearSpec | None:
        """This layer for ``cpu_kernels.block`` (None where our kernel does not run it)."""
        if not self.native or self.row_by_row:
            return None
        return cpu_kernels.linear_spec("q4", self.out_features, self.in_features, self.tiles, self.bias)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return cpu_kernels.q4_matmul(x, self.tiles, self.out_features)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_and_zeros)


class Int8Linear(WeightOnlyLinear):
    """``y = x @ W.T + b`` with ``W`` as int8 and float32 scales: one per output channel
    (quantized from a float weight), or one per group of 32 inputs (GGUF's Q8_0,
    :meth:`from_groups`; our kernels only). On our kernels ``x`` is quantized to 8 bits
    per group of 32 on the way (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 row_by_row: bool | None = None) -> None:
        """Quantize ``weight`` symmetrically, one scale per output channel."""
        q, scale = per_channel_int8(weight)
        self._setup(q, scale[:, None], bias, row_by_row)

    @classmethod
    def from_groups(cls, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                    row_by_row: bool | None = None) -> Int8Linear:
        """Weights stored as they are: ``q`` int8 ``[out, in]``, ``scale`` ``[out, in / 32]``,
        the weight being ``q * scale`` group by group (GGUF Q8_0). Needs our kernels."""
        if not native_kernels():
            raise RuntimeError("int8 groups of 32 need quickdraft's CPU kernels (cpu_kernels.library())")
        layer = cls.__new__(cls)
        layer._setup(q, scale, bias, row_by_row)
        return layer

    def _setup(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, row_by_row: bool | None) -> None:
        """``scale``: ``[out, 1]`` (per channel) or ``[out, in / 32]`` (per group)."""
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.native = native_kernels() and self.in_features % GROUP == 0
        scale = scale.float()
        if self.native:  # tiles of 16 output rows; our kernel takes a scale per group (a channel's repeated)
            groups = scale.expand(self.out_features, self.in_features // GROUP)
            self.tiles = cpu_kernels.pack_q8(q.to(torch.int8), groups)
        else:  # PyTorch's kernel: [out, in] and a scale per channel
            self.q, self.scale = q.to(torch.int8).contiguous(), scale[:, 0].contiguous()
        self.bias = None if bias is None else bias.detach().float().clone()
        self.row_by_row = not kernel_rows_are_invariant("int8") if row_by_row is None else row_by_row

    def dequantized(self) -> torch.Tensor:
        """The float32 weight these layers multiply by."""
        if self.native:
            q, scale = cpu_kernels.unpack_q8(self.tiles, self.out_features)
            return (q.float().view(self.out_features, -1, GROUP) * scale[..., None]).view_as(q)
        return self.q.float() * self.scale[:, None]

    def kernel_spec(self) -> cpu_kernels.LinearSpec | None:
        """This layer for ``cpu_kernels.block`` (None where our kernel does not run it)."""
        if not self.native or self.row_by_row:
            return None
        return cpu_kernels.linear_spec("q8", self.out_features, self.in_features, self.tiles, self.bias)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return cpu_kernels.q8_matmul(x, self.tiles, self.out_features)
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)


def per_channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` quantized symmetrically, one scale per output channel: int8 ``q`` and the
    float32 scales (``weight ~ q * scale[:, None]``)."""
    w = weight.detach().float()
    scale = w.abs().amax(1) / 127
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


QUANT_LINEARS = (Int4Linear, Int8Linear)


@functools.cache
def kernel_rows_are_invariant(kind: str, in_features: int = 64, out_features: int = 208,
                              max_rows: int = 40) -> bool:
    """Whether the ``kind`` (``int4`` or ``int8``) kernel rounds each row alike for every
    row count up to ``max_rows`` on this machine. Measured once per process."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(max_rows, in_features, generator=gen)
    layer = Int4Linear.from_weight(weight, row_by_row=False) if kind == "int4" else Int8Linear(weight, row_by_row=False)
    with torch.inference_mode():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(max_rows)])
        return all(torch.equal(layer(x[:rows]), alone[:rows]) for rows in range(1, max_rows + 1))


def block_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The float ``nn.Linear`` layers of the transformer blocks, by module name: what
    :func:`quantize_linears` replaces (the LM head is :func:`quantize_head`'s)."""
    return {name: module for name, module in model.named_modules()
            if type(module) is nn.Linear and name.startswith("layers.")}


def quantize_linears(model: nn.Module, mode: str,
                     int4_blocks: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
                     int8_blocks: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> int:
    """Replace ``model``'s block linears, in place. A GGUF file's own blocks are taken as
    they are: ``int4_blocks`` (``{module name: (q, scale, zero)}``, its Q4_0/Q4_1 linears)
    in modes ``auto`` and ``int4``, ``int8_blocks`` (``{name: (q, scale)}``, its Q8_0
    linears; our kernels only) in ``auto`` and ``int8``. ``int8`` / ``int4`` quantize
    every other block linear too; ``auto`` leaves them float. Layers whose shape a kernel
    refuses (input not a multiple of 32; for PyTorch's int4, output not of 16) keep
    float32. Returns how many layers were replaced."""
    q4, q8 = int4_blocks or {}, int8_blocks or {}
    native = native_kernels()
    count = 0
    for name, linear in block_linears(model).items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        bias = linear.bias
        fits_int4 = linear.in_features % GROUP == 0 and (native or linear.out_features % INT4_ROW_MULTIPLE == 0)
        if name in q8 and native and mode in ("auto", "int8"):
            new: nn.Module = Int8Linear.from_groups(*q8[name], bias)
        elif mode == "int8":
            new = Int8Linear(linear.weight, bias)
        elif name in q4 and mode in ("auto", "int4") and fits_int4:
            new = Int4Linear(*q4[name], bias)
        elif mode == "int4" and fits_int4:
            new = Int4Linear.from_weight(linear.weight, bias)
        else:
            continue
        setattr(parent, child, new)
        count += 1
    return count


def quantize_head(model: nn.Module, groups: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
    """Replace ``model.lm_head`` by an int8 layer, in place, where our kernels run (PyTorch's
    int8 kernel multiplies a large head slower than float32, so elsewhere it stays float):
    ``groups`` is a GGUF file's Q8_0 head ``(q, scale)``, taken as it is; without it the
    float weight is quantized per output channel. The embedding keeps its float table, so
    a tied head stops sharing it. Returns whether the head was replaced."""
    head = getattr(model, "lm_head", None)
    if not native_kernels() or type(head) is not nn.Linear or head.in_features % GROUP:
        return False
    model.lm_head = Int8Linear.from_groups(*groups, head.bias) if groups is not None else Int8Linear(head.weight, head.bias)
    return True


def is_quantized(model: nn.Module) -> bool:
    """Whether any of ``model``'s linears is quantized (``--quantize`` took effect)."""
    return any(isinstance(m, WeightOnlyLinear) for m in model.modules())


def quantize_drafter(module: nn.Module, beside: nn.Module | None = None) -> int:
    """Every float ``nn.Linear`` of a drafter (an EAGLE head) in int8 (:class:`Int8Linear`,
    the target's tiles), or in int4 (:class:`Int4Linear`, Q4_1's rule) when the target
    ``beside`` it keeps int4 layers, in place, where our kernels run: beside a quantized
    target its float32 weights would be a large share of each draft step, and a level reads
    them just after the target's pass evicted them (SmolLM2's Q4_1 target, its EAGLE
    drafter in int4 rather than int8, paired on the bench's prompts: a chain of 2 1.41 ->
    1.51x plain decoding on code, 1.12 -> 1.15x on chat, tau 1.99 -> 1.99 / 1.57 -> 1.53).
    A drafter's rounding never changes what the target accepts (greedy output stays plain
    decoding's, sampled output the target's distribution). Returns how many layers were
    replaced. A fused drafter's feature map stays int8 beside int4: it maps only each
    round's accepted states, and at the target's width it starts as the final state's
    identity, which int4's 16 levels per group of 32 would blur."""
    if not native_kernels():
        return 0
    int4 = beside is not None and any(isinstance(m, Int4Linear) for m in beside.modules())
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.in_features % GROUP == 0 and child.weight.device.type == "cpu":
                setattr(parent, name, Int4Linear.from_weight(child.weight, child.bias) if int4 and name != "feature_in"
                        else drafter_int8(child.weight, child.bias))
                count += 1
    return count


def drafter_int8(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
    """A drafter's int8 layer for ``weight`` (see :func:`quantize_drafter`): the target's
    int8 tiles, one scale per output channel. (A drafter-only kernel that applied the
    channel's scale once after the sum was retired in session 34: after the tiles stopped
    broadcasting x through a general register, they ran the embedded EAGLE drafter's
    chains faster.) Needs ``native_kernels()``."""
    return Int8Linear(weight, bias)
