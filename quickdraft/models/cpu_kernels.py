"""Our own AVX2 CPU kernels: matrix products with float32, int8 or int4 weights
(``kernels/qmatmul.c``; int4, int8 and several-row float32 on ``kernels/qmatmul_avx512.c``
where the CPU has AVX-512: same results bit for bit, see :func:`kernel_isa`; int8 weights
take 8-bit activations, as llama.cpp runs Q8_0: ``kernels/q8a8.h``), a decoder layer's
non-matrix work fused into one call each, a whole Llama block, or all of a model's
blocks, in one call, and a greedy draft chain in one call (``kernels/layer_ops.c``).

PyTorch's CPU int8 and int4 kernels are slower than the float32 product they would
replace (torch 2.13, even on this AVX-512 host: 380 us for a 1536x576 int8 product at one
row, float32 126 us, ours 36 us). oneDNN's float32 product rounds a row differently with
one row than with several at some widths; ours rounds every row alike (what lossless
verify passes need) and is faster for one row. And a small model's decode step is mostly
per-op overhead: RMSNorm, RoPE, the KV-cache write and attention are ~40 PyTorch calls a
layer, where :func:`rms_norm`, :func:`attend` and :func:`silu_mul` are
one each (:func:`fused_layers` says when the model uses them). The C files (no
dependencies) are compiled once per machine with the system C compiler into
``$XDG_CACHE_HOME/quickdraft/kernels/`` and called through ``ctypes``; the compiled library
is keyed by the sources' hash and the compiler flags. Where there is no
compiler or no AVX2, :func:`library` returns ``None`` and callers keep PyTorch's kernels.

``QUICKDRAFT_NATIVE_KERNELS=0`` turns them off (to compare, or to rule them out).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SOURCES = tuple(Path(__file__).with_name("kernels") / name
                for name in ("qmatmul.c", "qmatmul_avx512.c", "bf16_products.c", "layer_ops.c",
                              "attend_avx512.c"))
# Every header, named in the build's digest: one left out (q4a8.h was) let an edit of it
# run the stale library.
HEADERS = tuple(sorted(Path(__file__).with_name("kernels").glob("*.h")))
# -ffp-contract=off: the compiler must not fuse or reorder float operations differently in
# the row-count specializations, so every row rounds alike (see the source's comment).
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared")
_c_int64, _ptr, _c_float, _c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int


def _cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "quickdraft" / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def _key(compiler: str) -> str:
    """The digest of the sources, the flags and the compiler: names the compiled library
    (read once a process: every cost-cache lookup asks for it through :func:`fingerprint`)."""
    sources = b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS))
    return hashlib.sha256(sources + " ".join((compiler, *FLAGS)).encode()).hexdigest()[:16]


def _build(compiler: str) -> Path:
    """Compile the source once per (source, flags, compiler); concurrent builds are safe
    (each writes a private file, then renames it into place)."""
    target = _cache_root() / f"qmatmul-{_key(compiler)}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError:  # an unusable cache directory: build for this process alone
            target = Path(tempfile.mkdtemp(prefix="quickdraft-kernels-")) / target.name
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", tmp, "-lm"], check=True, capture_output=True,
                           text=True)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot run here (no AVX2, no C compiler,
    turned off): callers fall back to PyTorch's kernels."""
    if os.environ.get("QUICKDRAFT_NATIVE_KERNELS", "1") == "0":
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    compiler = _compiler()
    if compiler is None:
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError):
        return None
    lib.qd_q8_matmul.argtypes = [_ptr, _c_int64, _c_int64, _ptr, _c_int64, _ptr, ctypes.c_int]
    lib.qd_q4_matmul.argtypes = [_ptr, _c_int64, _c_int64, _ptr, _c_int64, _ptr, ctypes.c_int]
    lib.qd_f32_matmul.argtypes = [_ptr, _c_int64, _c_int64, _ptr, _c_int64, _ptr, ctypes.c_int]
    lib.qd_bf16_matmul.argtypes = [_ptr, _c_int64, _c_int64, _ptr, _c_int64, _ptr, ctypes.c_int]
    lib.qd_f16_matmul.argtypes = [_ptr, _c_int64, _c_int64, _ptr, _c_int64, _ptr, ctypes.c_int]
    lib.qd_vnni_supported.restype = ctypes.c_int
    lib.qd_bf16dp_matmul.argtypes = [_ptr, _c_int64, _c_int64, _ptr, _c_int64, _ptr, ctypes.c_int]
    lib.qd_bf16dp_supported.restype = ctypes.c_int
    lib.qd_rms_norm.argtypes = [_ptr, _c_int64, _c_int64, _ptr, _c_float, _ptr]
    lib.qd_silu_mul.argtypes = [_ptr, _c_int64, _c_int64, _ptr]
    lib.qd_argmax_rows.argtypes = [_ptr, _c_int64, _c_int64, _c_int64, _ptr]
    lib.qd_argmax_ids.argtypes = [_ptr, _c_int64, _ptr, _c_int64]
    lib.qd_argmax_ids.restype = _c_int64
    lib.qd_attend.argtypes = [_ptr, _c_int64, _c_int64, _c_int64, _c_int64, _ptr, _ptr, _ptr, _ptr, _c_int64,
                              _c_int64, _ptr, _c_int64, _c_int64, _ptr, _c_int64, _ptr, _c_int]
    lib.qd_block.argtypes = [_ptr, _c_int64, _c_int64, _ptr, _ptr, _c_float, _ptr, _ptr, _ptr, _ptr, _c_int64,
                             _c_int64, _c_int64, _ptr, _ptr, _ptr, _ptr, _c_int64, _c_int64, _ptr, _c_int64, _c_int64, _ptr,
                             _c_int64, _ptr, _c_int]
    lib.qd_kernel_isa.argtypes = [ctypes.c_int]
    lib.qd_kernel_isa.restype = ctypes.c_int
    if os.environ.get("QUICKDRAFT_KERNEL_ISA", "").lower() == "avx2":
        lib.qd_kernel_isa(0)
    lib.qd_blocks.argtypes = [_ptr, _c_int64, _c_int64, _c_int64, _ptr, _c_float, _ptr, _c_int64, _c_int64,
                              _c_int64, _ptr, _ptr, _ptr, _ptr, _c_int64, _c_int64, _c_int64, _ptr, _c_int64, _c_int64, _ptr,
                              _c_int64, _ptr, _c_int]
    lib.qd_blocks_ragged.argtypes = [_ptr, _c_int64, _c_int64, _c_int64, _ptr, _c_float, _ptr, _c_int64, _c_int64,
                                     _c_int64, _ptr, _ptr, _ptr, _ptr, _c_int64, _c_int64, _c_int64, _ptr, _c_int64, _ptr,
                                     ctypes.c_int]
    lib.qd_forward_tapped.argtypes = [_ptr, _c_int64, _c_int64, _ptr, _c_float, _ptr, _c_int64, _c_int64, _c_int64,
                                      _ptr, _ptr, _ptr, _ptr, _c_int64, _c_int64, _c_int64, _c_int64, _ptr, _c_float,
                                      _ptr, _c_int64, _ptr, _c_int64, _ptr, _c_int64, _ptr, _ptr, _c_int64, _ptr,
                                      ctypes.c_int]
    lib.qd_forward_tapped.restype = _c_int64
    lib.qd_greedy_chain.argtypes = [_ptr, _c_int64, _c_int64, _ptr, _c_float, _ptr, _c_int64, _c_int64, _c_int64,
                                    _ptr, _ptr, _ptr, _ptr, _c_int64, _c_int64, _c_int64, _c_int64, _ptr, _c_float, _ptr,
                                    _ptr, _c_int64, _ptr, _c_int64, _ptr, _c_int64, _c_float, _ptr, _c_int64, _c_int]
    lib.qd_greedy_chain.restype = _c_int64
    lib.qd_eagle_chain.argtypes = [_ptr, _c_float, _c_int64, _ptr, _ptr, _c_float, _ptr, _c_int64, _c_int64, _c_int64,
                                   _ptr, _ptr, _ptr, _ptr, _c_int64, _c_int64, _c_int64, _c_int64, _ptr, _c_float, _ptr, _ptr,
                                   _c_int64, _ptr, _ptr, _ptr, _ptr, _c_int64, _c_int64, _ptr, _c_int64, _c_float,
                                   _c_int]
    lib.qd_eagle_chain.restype = _c_int64
    lib.qd_spec_rounds.argtypes = [
        # the target (ForwardCall's)
        _ptr, _c_int64, _c_int64, _ptr, _c_float, _ptr, _c_int64, _c_int64, _c_int64, _ptr, _ptr, _c_int64, _c_int64,
        _c_int64, _ptr, _c_float, _ptr, _c_int64,
        # an EAGLE drafter (EagleChain's)
        _ptr, _c_float, _c_int64, _ptr, _ptr, _c_float, _ptr, _c_int64, _c_int64, _ptr, _ptr, _c_int64, _c_int64,
        _c_int64, _ptr, _c_float, _ptr, _ptr, _c_int64, _ptr, _ptr, _c_int64,
        # a draft model (chain_model's)
        _ptr, _c_int64, _c_int64, _ptr, _c_float, _ptr, _c_int64, _c_int64, _c_int64, _ptr, _ptr, _ptr, _ptr, _c_int64,
        _c_int64, _c_int64, _ptr, _c_float, _ptr, _ptr, _c_int64,
        # the rounds
        _ptr, _ptr, _ptr, _ptr, _ptr, _c_int64, _ptr, _c_int64, _c_int64, _c_int64, _c_int64, _c_int64, _c_int64,
        _c_int64, _c_int64, _ptr, _c_int64, _ptr, _ptr, _c_int64, _c_int]
    lib.qd_spec_rounds.restype = _c_int64
    for fn in (lib.qd_block, lib.qd_blocks, lib.qd_blocks_ragged, lib.qd_q8_matmul, lib.qd_q4_matmul, lib.qd_f32_matmul, lib.qd_bf16_matmul, lib.qd_f16_matmul, lib.qd_bf16dp_matmul, lib.qd_rms_norm, lib.qd_silu_mul, lib.qd_attend, lib.qd_argmax_rows):
        fn.restype = None
    return lib


def kernel_isa(want: str | None = None) -> str:
    """Which int4, int8 and several-row float32 matrix products run: ``"avx512"`` where
    the CPU has AVX512F (int8: with AVX-512 VNNI), else ``"avx2"`` (both round every
    element alike, so the choice changes only speed). ``want``
    switches (``"avx2"`` always works; ``"avx512"`` only where supported);
    ``QUICKDRAFT_KERNEL_ISA=avx2`` starts a process on the AVX2 products. Needs :func:`library`."""
    lib = library()
    assert lib is not None, "kernel_isa needs the compiled kernels (cpu_kernels.library())"
    if want not in (None, "avx2", "avx512"):
        raise ValueError(f"kernel ISA must be 'avx2' or 'avx512', not {want!r}")
    return "avx512" if lib.qd_kernel_isa(-1 if want is None else int(want == "avx512")) else "avx2"


def fingerprint() -> str:
    """What identifies the kernels that run here (measured step costs change with them):
    the compiled library's digest and :func:`kernel_isa`, or ``"none"``."""
    if library() is None:
        return "none"
    return f"{_key(_compiler())}-{kernel_isa()}"


def q8_matmul(x: torch.Tensor, blocks: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x @ W.T`` for the int8 weight :func:`pack_q8` laid out: ``x`` float32 ``[M, K]``
    quantized on the way, per row and group of 32 (``d = max|x| / 127``, ``x / d`` rounded
    half to even: see ``kernels/q8a8.h``), as llama.cpp quantizes activations for Q8_0
    weights, so each group's product is an exact integer sum. Needs :func:`library`."""
    lib = library()
    assert lib is not None, "q8_matmul needs the compiled kernels (cpu_kernels.library())"
    x = x.contiguous()
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    lib.qd_q8_matmul(x.data_ptr(), x.shape[0], x.shape[1], blocks.data_ptr(), out_features, y.data_ptr(),
                     torch.get_num_threads())
    return y


def f32_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ W.T``, ``x`` float32 ``[M, K]``, ``W`` float32 ``[N, K]`` contiguous, ``K % 32 == 0``:
    each row rounded alike whatever ``M`` (see ``DecodeLinear``)."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    library().qd_f32_matmul(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), weight.shape[0], y.data_ptr(),
                            torch.get_num_threads())
    return y


def half_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`f32_matmul` for a ``bfloat16`` or ``float16`` weight ``[N, K]``: each weight
    widened to its exact float32 value, then the same arithmetic, so the same result bit
    for bit from half the bytes (decoding streams every weight each step)."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    product = library().qd_bf16_matmul if weight.dtype == torch.bfloat16 else library().qd_f16_matmul
    product(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), weight.shape[0], y.data_ptr(),
            torch.get_num_threads())
    return y


def bf16_products_supported() -> bool:
    """Whether :func:`bf16_products` runs here (our kernels, AVX512_BF16)."""
    lib = library()
    return lib is not None and bool(lib.qd_bf16dp_supported())


def bf16_products(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``bf16(x) @ W.T`` with float32 sums, ``x`` float32 ``[M, K]`` rounded to bfloat16
    first, ``W`` bfloat16 ``[N, K]``, ``K % 32 == 0`` (``kernels/bf16_products.c``): what
    ``--dtype bfloat16`` multiplies with on a CPU that has AVX512_BF16. Each row rounded alike
    whatever ``M``. Needs :func:`bf16_products_supported`."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    library().qd_bf16dp_matmul(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), weight.shape[0],
                               y.data_ptr(), torch.get_num_threads())
    return y


def q4_matmul(x: torch.Tensor, blocks: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x @ W.T`` for the int4 weight :func:`pack_q4` laid out, ``x`` quantized to 8 bits
    per group of 32 on the way (``kernels/q4a8.h``: the rule, exact integer sums per group,
    each row rounded alike whatever the row count)."""
    lib = library()
    assert lib is not None, "q4_matmul needs the compiled kernels (cpu_kernels.library())"
    x = x.contiguous()
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    lib.qd_q4_matmul(x.data_ptr(), x.shape[0], x.shape[1], blocks.data_ptr(), out_features, y.data_ptr(),
                     torch.get_num_threads())
    return y


#: Weight rows per int8 or int4 tile (``kernels/q8a8.h``).
Q_TILE = 16


def _tiled(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[N, G]`` per row and group -> ``[T, G, 16]`` per tile, group and lane (missing rows 0)."""
    n, groups = t.shape
    tiles = -(-n // Q_TILE)
    t = torch.cat([t.to(dtype), t.new_zeros(tiles * Q_TILE - n, groups, dtype=dtype)])
    return t.reshape(tiles, Q_TILE, groups).transpose(1, 2).contiguous()


def _per_row(t: torch.Tensor, out_features: int) -> torch.Tensor:
    """:func:`_tiled` undone: ``[T, G, 16]`` -> ``[N, G]``."""
    return t.transpose(1, 2).reshape(-1, t.shape[1])[:out_features]


def _padded_rows(q: torch.Tensor) -> torch.Tensor:
    pad = -q.shape[0] % Q_TILE
    return torch.cat([q, q.new_zeros(pad, q.shape[1])]) if pad else q


#: Bytes of an int8 block (one tile's group of 32 weights): weights (q + 128), then float32 scales.
Q8_WEIGHT_BYTES, Q8_BLOCK_BYTES = 512, 576


def pack_q8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The int8 weight ``W = q * scale`` (``q`` ``[N, K]`` int8, ``scale`` ``[N, K / 32]``) as
    :func:`q8_matmul` takes it: ``[T, K / 32, 576]`` uint8 (``T = ceil(N / 16)``, missing
    rows zero), per tile of 16 weight rows and group the weights as ``q + 128`` (unsigned
    bytes: what VNNI multiplies the signed activations by), then the rows' ``scale``
    (float32), so one stream holds everything a product reads. ``kernels/q8a8.h`` documents
    the bytes."""
    n, k = q.shape
    groups = k // 32
    v = _padded_rows(q.to(torch.int8)).view(torch.uint8) ^ 0x80
    # q[16t + i][32g + 4h + b] -> [t, g, h, i, b]
    weights = v.reshape(-1, Q_TILE, groups, 8, 4).permute(0, 2, 3, 1, 4).reshape(-1, groups, Q8_WEIGHT_BYTES)
    return torch.cat([weights, _tiled(scale).view(torch.uint8)], -1).contiguous()


def unpack_q8(blocks: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pack_q8` undone: ``q`` ``[N, K]`` int8 and ``scale`` ``[N, K / 32]``."""
    t, groups = blocks.shape[:2]
    weights = (blocks[..., :Q8_WEIGHT_BYTES] ^ 0x80).view(torch.int8)
    q = weights.reshape(t, groups, 8, Q_TILE, 4).permute(0, 3, 1, 2, 4).reshape(t * Q_TILE, groups * 32)
    scale = blocks[..., Q8_WEIGHT_BYTES:].contiguous().view(torch.float32)
    return q[:out_features], _per_row(scale, out_features)


#: Bytes of an int4 block (one tile's group of 32 weights): nibbles, then float16 scales and offsets.
Q4_NIBBLE_BYTES, Q4_BLOCK_BYTES = 256, 320


def pack_q4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The int4 weight ``W = (q - 8) * scale + zero`` (``q`` ``[N, K]`` integers in 0..15,
    ``scale`` and ``zero`` ``[N, K / 32]``) as :func:`q4_matmul` takes it: ``[T, K / 32, 320]``
    uint8 (``T = ceil(N / 16)``, missing rows zero), per tile of 16 weight rows and group
    the nibbles, then the rows' ``scale`` and ``offset = zero - 8 * scale`` as float16, so
    one stream holds everything a product reads. Both are rounded to float16 (exact for
    GGUF's Q4_0/Q4_1, whose d and m are float16). ``kernels/q4a8.h`` documents the bytes."""
    groups = q.shape[1] // 32
    # q[16t + i][32g + 8h + 4j + b] -> [t, g, h, i, b, j]: j = 0 low nibble, 1 high.
    v = _padded_rows(q.to(torch.uint8)).reshape(-1, Q_TILE, groups, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    nibbles = (v[..., 0] | (v[..., 1] << 4)).reshape(-1, groups, Q4_NIBBLE_BYTES)
    side = torch.cat([_tiled(scale, torch.float16), _tiled(zero.float() - 8 * scale.float(), torch.float16)], -1)
    return torch.cat([nibbles, side.view(torch.uint8)], -1).contiguous()


def q4_scales(blocks: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-row ``scale`` and ``offset`` ``[N, K / 32]`` (float32) that :func:`pack_q4`'s blocks hold."""
    side = blocks[..., Q4_NIBBLE_BYTES:].contiguous().view(torch.float16).float()
    return _per_row(side[..., :Q_TILE], out_features), _per_row(side[..., Q_TILE:], out_features)


def unpack_q4(blocks: torch.Tensor, out_features: int) -> torch.Tensor:
    """The float32 weight ``q * scale + offset`` ``[N, K]`` that :func:`pack_q4`'s blocks hold
    (what :func:`q4_matmul` multiplies the quantized activations by)."""
    t, groups = blocks.shape[:2]
    nibbles = blocks[..., :Q4_NIBBLE_BYTES]
    v = torch.stack([nibbles & 0x0F, nibbles >> 4], -1).view(t, groups, 4, Q_TILE, 4, 2)
    q = v.permute(0, 3, 1, 2, 5, 4).reshape(t * Q_TILE, groups, 32)[:out_features].float()
    scale, offset = q4_scales(blocks, out_features)
    return (q * scale[..., None] + offset[..., None]).reshape(out_features, groups * 32)


class LinearSpec(ctypes.Structure):
    """One linear layer's weights as ``qd_block`` reads them (``layer_ops.c``'s ``QdLinear``)."""

    _fields_ = [("kind", _c_int64), ("in_features", _c_int64), ("out_features", _c_int64), ("q", _ptr),
                ("bias", _ptr)]


#: ``LinearSpec.kind`` of each weight format.
LINEAR_KINDS = {"f32": 0, "q8": 1, "q4": 2, "bf16": 3, "f16": 4, "bf16dp": 6}  # (5: retired)


def linear_spec(kind: str, out_features: int, in_features: int, q: torch.Tensor,
                bias: torch.Tensor | None = None) -> LinearSpec:
    """A ``LinearSpec`` pointing at these tensors (the layer that owns them must outlive it):
    ``kind`` ``f32`` / ``bf16`` / ``f16`` (``q`` is the weight in that format), ``q8`` or
    ``q4`` (``q``: the blocks :func:`pack_q8` / :func:`pack_q4` write), ``bf16dp`` (a
    bfloat16 weight that :func:`bf16_products` multiplies)."""
    return LinearSpec(LINEAR_KINDS[kind], in_features, out_features, q.data_ptr(),
                      None if bias is None else bias.data_ptr())


def block(x: torch.Tensor, norms: tuple[torch.Tensor, torch.Tensor, float], specs: tuple[LinearSpec, ...],
          n_heads: int, rope: tuple[torch.Tensor, torch.Tensor] | None, k_cache: torch.Tensor,
          v_cache: torch.Tensor, layer: int, slots: torch.Tensor | int, kv_len: int,
          mask: torch.Tensor | None) -> torch.Tensor:
    """A whole pre-norm Llama block over batch row 0 (``x``: ``[1, T, hidden]``) in one call:
    the same kernels in the same order as the per-op fused path (so the same result, bit
    for bit). ``norms``: the attention and MLP RMSNorm weights and eps; ``specs``: the q/k/v,
    output, gate/up and down linears; ``n_heads``: query heads; the rest as :func:`attend`
    takes them (cache row 0)."""
    x = x.contiguous()
    y = torch.empty_like(x)
    args, _alive = _attention_args(n_heads, rope, k_cache, v_cache, layer, 0, slots, kv_len, mask)
    library().qd_block(
        x.data_ptr(), x.shape[-2], x.shape[-1], norms[0].data_ptr(), norms[1].data_ptr(), norms[2],
        *(ctypes.addressof(spec) for spec in specs), *args, y.data_ptr(), torch.get_num_threads(),
    )
    return y


class BlockStack:
    """Consecutive Llama blocks as ``qd_blocks`` takes them: per block its two RMSNorm
    weights and its four ``LinearSpec``s (which point into the blocks' linears: the model
    must outlive this)."""

    def __init__(self, norms: list[tuple[torch.Tensor, torch.Tensor]], eps: float,
                 specs: list[tuple[LinearSpec, ...]]) -> None:
        self.n = len(specs)
        self.eps = eps
        self.norms = (ctypes.c_void_p * (2 * self.n))(*(w.data_ptr() for pair in norms for w in pair))
        self.linears = (LinearSpec * (4 * self.n))(*(spec for block_specs in specs for spec in block_specs))
        self._alive = norms


def blocks(x: torch.Tensor, stack: BlockStack, n_heads: int, rope: tuple[torch.Tensor, torch.Tensor] | None,
           k_cache: torch.Tensor, v_cache: torch.Tensor, first_layer: int, slots: torch.Tensor | int, kv_len: int,
           mask: torch.Tensor | None) -> torch.Tensor:
    """The blocks of ``stack`` (layers ``first_layer ..`` of the cache) over batch row 0 in
    one call: what :func:`block` does layer after layer, bit for bit, without returning to
    Python between layers. Arguments as :func:`block` takes them."""
    x = x.contiguous()
    y = torch.empty_like(x)
    args, _alive = _attention_args(n_heads, rope, k_cache, v_cache, first_layer, 0, slots, kv_len, mask)
    layer_stride = k_cache.stride(0)
    library().qd_blocks(
        x.data_ptr(), x.shape[-2], x.shape[-1], stack.n, stack.norms, stack.eps, stack.linears,
        *args[:7], layer_stride, *args[7:], y.data_ptr(), torch.get_num_threads(),
    )
    return y


class RowSpec(ctypes.Structure):
    """One row of a pass as ``qd_blocks_ragged`` reads it (``layer_ops.c``'s ``QdRows``)."""

    _fields_ = [("offset", _c_int64), ("tokens", _c_int64), ("cache", _c_int64), ("slots", _ptr),
                ("start", _c_int64), ("kv_len", _c_int64), ("mask", _ptr), ("mask_stride", _c_int64)]


def blocks_ragged(x: torch.Tensor, stack: BlockStack, n_heads: int, rope: tuple[torch.Tensor, torch.Tensor] | None,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, first_layer: int,
                  rows: Sequence[tuple[Any, torch.Tensor | None]]) -> torch.Tensor:
    """:func:`blocks` over a ragged pass (``x``: ``[1, T, hidden]``, the rows' tokens packed
    one after another; ``rows``: each ``RaggedRow`` with its additive causal mask or None,
    as ``Transformer.ragged_inputs`` gives them): each row attends in its own cache row over
    its own slots, as ``Attention._fused``'s row loop does, bit for bit, in one call."""
    x = x.contiguous()
    y = torch.empty_like(x)
    _, _, n_kv_heads, max_len, head_dim = k_cache.shape
    tables = () if rope is None else tuple(t.contiguous() for t in rope)
    cos, sin = (t.data_ptr() for t in tables) if tables else (None, None)
    masks = [None if mask is None else mask.contiguous() for _, mask in rows]
    specs = (RowSpec * len(rows))(*(
        RowSpec(row.offset, row.tokens, row.cache_row * k_cache.stride(1), None, row.start, row.start + row.tokens,
                None if mask is None else mask.data_ptr(), 0 if mask is None else mask.shape[-1])
        for (row, _), mask in zip(rows, masks)))
    layer = first_layer * k_cache.stride(0) * k_cache.element_size()
    library().qd_blocks_ragged(
        x.data_ptr(), x.shape[-2], x.shape[-1], stack.n, stack.norms, stack.eps, stack.linears, n_heads, n_kv_heads,
        head_dim, cos, sin, k_cache.data_ptr() + layer, v_cache.data_ptr() + layer, k_cache.stride(0), max_len,
        half_cache(k_cache), specs, len(rows), y.data_ptr(), torch.get_num_threads(),
    )
    return y


def greedy_chain(first: int | None, n: int, embed: torch.Tensor, stack: BlockStack, n_heads: int,
                 rope: tuple[torch.Tensor, torch.Tensor] | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 start: int, final_norm: tuple[torch.Tensor, float], head: LinearSpec,
                 head_ids: torch.Tensor | None, vocab: int, feed: torch.Tensor | None = None,
                 min_confidence: float = 0.0, stop_ids: Sequence[int] = ()) -> list[int]:
    """A greedy chain of ``n`` tokens after ``first`` in one call: each step feeds the last
    token at position and cache slot ``start + i`` (its ``embed`` row, the blocks of
    ``stack`` from layer 0, ``final_norm``'s RMSNorm, ``head``) and takes the argmax of its
    logits as ``torch.argmax`` would (over ids below ``vocab``; ``head_ids``: the ids of a
    restricted head's rows). With ``feed`` (``m`` token ids, ``first`` None), those are fed
    first at ``start - m ..`` in one causal pass and ``first`` is the argmax of its last
    row. ``rope``: cos and signed sin for positions ``start - m .. start + n - 1`` (``[m +
    n, D]`` each, contiguous). Returns ``[first, t1, .., tn]``; with ``min_confidence`` > 0
    (and ``feed``) it ends after the first of them, before ``tn``, whose softmax top-1
    probability is below it (``--draft-stop confidence:T`` / ``dv`` in the call), fed up to
    the token before it. It also ends at the first token in ``stop_ids`` (EOS: nothing is
    computed past the end of a text)."""
    tokens = torch.empty(n + 1, dtype=torch.int64)
    if feed is None:
        tokens[0] = first
    fed = None if feed is None else feed.to(torch.int64).contiguous()
    ids, cos, sin, _alive = _chain_args(head_ids, rope)
    stops = torch.tensor(list(stop_ids), dtype=torch.int64) if stop_ids else None
    _, _, n_kv_heads, max_len, head_dim = k_cache.shape
    count = library().qd_greedy_chain(
        embed.data_ptr(), embed.shape[1], stack.n, stack.norms, stack.eps, stack.linears, n_heads, n_kv_heads,
        head_dim, cos, sin, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), max_len, half_cache(k_cache),
        start, final_norm[0].data_ptr(), final_norm[1], ctypes.addressof(head), ids, vocab,
        None if fed is None else fed.data_ptr(), 0 if fed is None else fed.numel(), tokens.data_ptr(), n,
        min_confidence, None if stops is None else stops.data_ptr(), 0 if stops is None else stops.numel(),
        torch.get_num_threads())
    return tokens[:count].tolist()


class ForwardCall:
    """A Llama model's causal pass over new tokens of cache row 0 in one call
    (``qd_forward``: embedding rows, the blocks of ``stack``, ``final_norm`` and ``head``),
    its fixed arguments set up once: a pass passes only the tokens, the position and the
    RoPE rows. ``Transformer.forward`` over such a pass gives the same results bit for bit
    (the same kernels in the same order) after ~0.5 ms more of Python a SmolLM2 step, most
    of it cache misses (the step's weights have just streamed through the caches). The
    tensors behind the arguments must outlive it (it keeps references)."""

    def __init__(self, embed: torch.Tensor, stack: BlockStack, n_heads: int, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, final_norm: tuple[torch.Tensor, float], head: LinearSpec) -> None:
        self._alive = (embed, stack, k_cache, v_cache, final_norm[0], head)
        _, _, n_kv_heads, max_len, head_dim = k_cache.shape
        self.hidden, self.vocab = embed.shape[1], head.out_features
        self._model = (embed.data_ptr(), self.hidden, stack.n, stack.norms, stack.eps, stack.linears, n_heads,
                       n_kv_heads, head_dim)
        self._keys, self._values = k_cache.data_ptr(), v_cache.data_ptr()
        self._row_bytes = k_cache.stride(1) * k_cache.element_size()
        self._cache = (k_cache.stride(0), max_len, half_cache(k_cache))
        self._head = (final_norm[0].data_ptr(), final_norm[1], ctypes.addressof(head), embed.shape[0])

    def __call__(self, tokens: torch.Tensor, start: int, rope: tuple[torch.Tensor, torch.Tensor],
                 rows: int, cache_row: int = 0, states: Sequence[int] = ()
                 ) -> tuple[torch.Tensor, torch.Tensor | None, dict[int, torch.Tensor]] | None:
        """Feed ``tokens`` (``[m]`` int64, contiguous) at positions and slots ``start .. start
        + m - 1`` of cache row ``cache_row``, causally after what it holds; ``rope``: their cos
        and signed sin rows (``[m, D]`` each, contiguous). Returns the final hidden states
        ``[m, H]`` (before the norm), the logits of the last ``rows`` tokens (None for 0) and
        the hidden states of the layers in ``states`` (1 .. the layer count, the final one
        included; an EAGLE-3 drafter's fused layers), by layer; None, with nothing written,
        where a token is not a row of the embedding."""
        m, final = tokens.numel(), self._model[2]
        x = torch.empty(m, self.hidden, dtype=torch.float32)
        logits = torch.empty(rows, self.vocab, dtype=torch.float32) if rows else None
        taps = sorted({layer for layer in states if layer != final})
        tapped = tap_ids = None
        if taps:  # (nothing to allocate on a plain step: this is the decode loop's pass)
            tapped = torch.empty(m, len(taps), self.hidden, dtype=torch.float32)
            tap_ids = torch.tensor(taps, dtype=torch.int64)
        offset = cache_row * self._row_bytes
        status = library().qd_forward_tapped(
            *self._model, rope[0].data_ptr(), rope[1].data_ptr(), self._keys + offset, self._values + offset,
            *self._cache, start, *self._head, tokens.data_ptr(), m, x.data_ptr(), rows,
            None if logits is None else logits.data_ptr(), None if tap_ids is None else tap_ids.data_ptr(), len(taps),
            None if tapped is None else tapped.data_ptr(), torch.get_num_threads())
        if status:
            return None
        by_layer = {final: x, **{layer: tapped[:, i] for i, layer in enumerate(taps)}}
        return x, logits, {layer: by_layer[layer] for layer in states}


def _chain_args(head_ids: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor] | None) -> tuple:
    """A chain call's head-id, cos and sin pointers (or None), and the tensors behind them."""
    ids = None if head_ids is None else head_ids.to(torch.int64).contiguous()
    tables = () if rope is None else tuple(t.contiguous() for t in rope)
    cos, sin = (t.data_ptr() for t in tables) if tables else (None, None)
    return None if ids is None else ids.data_ptr(), cos, sin, (ids, tables)


class EagleChain:
    """An EAGLE drafter's feed and greedy chain in one call (``qd_eagle_chain``), its fixed
    arguments (weights, head, KV cache) set up once: a round passes only what changes. Built
    from scratch each round, the call's Python took ~100 us of a round in the decode loop
    (where every PyTorch call runs on caches the verify pass has just evicted).

    The weights: ``embed`` (the token embedding, scaled by ``embed_scale``), ``fc`` (over
    the scaled embedding and the unit-RMS feature), the one block of ``stack``,
    ``final_norm`` (weight, eps) and ``head`` over ``head_ids`` (None: all ids) of a
    ``vocab``-token vocabulary; ``feature_in``: a narrow drafter's map from the target's
    states (each of the ``feature_chunks`` states side by side in a row at unit RMS, then
    the linear, as ``EagleHead.from_target`` does), or None. The tensors and specs must
    outlive the object (it keeps references)."""

    def __init__(self, embed: torch.Tensor, embed_scale: float, fc: LinearSpec, stack: BlockStack, n_heads: int,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, final_norm: tuple[torch.Tensor, float],
                 head: LinearSpec, head_ids: torch.Tensor | None, vocab: int, feature_in: LinearSpec | None,
                 feature_chunks: int) -> None:
        ids = None if head_ids is None else head_ids.to(torch.int64).contiguous()
        self._alive = (embed, fc, stack, k_cache, v_cache, final_norm[0], head, ids, feature_in)
        _, _, n_kv_heads, max_len, head_dim = k_cache.shape
        self._model = (embed.data_ptr(), embed_scale, embed.shape[1], ctypes.addressof(fc), stack.norms, stack.eps,
                       stack.linears, n_heads, n_kv_heads, head_dim)
        self._cache = (k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), max_len, half_cache(k_cache))
        self._head = (final_norm[0].data_ptr(), final_norm[1], ctypes.addressof(head),
                      None if ids is None else ids.data_ptr(), vocab)
        self.maps = feature_in is not None
        self._feature_in = None if feature_in is None else ctypes.addressof(feature_in)
        self._chunks = feature_chunks
        self._feature = torch.empty(embed.shape[1], dtype=torch.float32)
        self._tokens = torch.empty(16, dtype=torch.int64)

    def __call__(self, feed_tokens: torch.Tensor, feed_features: torch.Tensor, n: int,
                 rope: tuple[torch.Tensor, torch.Tensor], start: int, min_confidence: float = 0.0,
                 raw: bool = False) -> list[int]:
        """Feed ``feed_tokens`` ``[m]``, each with ``feed_features`` ``[m, H]`` (the target's
        feature of the token before it; ``raw``: the target's own states, which
        ``feature_in`` maps first), at cache slots ``start - m .. start - 1``, causally; then
        ``n`` tokens: each the argmax of the head over the final-normed feature, the first
        from the feed's last output, each later one from the output of one level fed the
        token before it at slot ``start + i``. ``rope``: cos and signed sin of the ``m + n -
        1`` positions fed (contiguous rows). ``min_confidence`` > 0: the chain ends after the
        first token, before the ``n``-th, whose softmax top-1 probability (over the head's
        tokens) is below it."""
        feed = feed_tokens if feed_tokens.dtype == torch.int64 and feed_tokens.is_contiguous() else \
            feed_tokens.to(torch.int64).contiguous()
        features = feed_features if feed_features.dtype == torch.float32 and feed_features.is_contiguous() else \
            feed_features.float().contiguous()
        cos, sin = (t if t.is_contiguous() else t.contiguous() for t in rope)
        if self._tokens.numel() < n:
            self._tokens = torch.empty(n, dtype=torch.int64)
        count = library().qd_eagle_chain(
            *self._model, cos.data_ptr(), sin.data_ptr(), *self._cache, start, *self._head,
            self._feature.data_ptr(), feed.data_ptr(), features.data_ptr(), self._feature_in if raw else None,
            self._chunks, feed.numel(), self._tokens.data_ptr(), n, min_confidence, torch.get_num_threads())
        return self._tokens.tolist()[:count]


@dataclass
class SpecRounds:
    """What :func:`spec_rounds` did: each round's ``(drafted, accepted, settled)`` counts (the
    settled tokens follow each other in the sequence after its old length), the target
    cache's new length, the EAGLE drafter's ``fed`` and ``known`` positions, the draft
    model's cache length (``drafted``), and whether the target's pass refused a token (the
    rounds before it stand)."""

    rounds: list[tuple[int, int, int]]
    cached: int
    fed: int
    known: int
    drafted: int
    refused: bool


def chain_model(embed: torch.Tensor, stack: BlockStack, n_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                final_norm: tuple[torch.Tensor, float], head: LinearSpec, head_ids: torch.Tensor | None, vocab: int,
                rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[tuple, tuple]:
    """A draft model's arguments for :func:`spec_rounds`' greedy chains (:func:`greedy_chain`'s,
    ``rope`` its cos and signed sin from position 0), and the tensors behind them (keep them
    while the call runs)."""
    ids, cos, sin, alive = _chain_args(head_ids, rope)
    _, _, n_kv_heads, max_len, head_dim = k_cache.shape
    args = (embed.data_ptr(), embed.shape[1], stack.n, stack.norms, stack.eps, stack.linears, n_heads, n_kv_heads,
            head_dim, cos, sin, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), max_len,
            half_cache(k_cache), final_norm[0].data_ptr(), final_norm[1], ctypes.addressof(head), ids, vocab)
    return args, (embed, stack, k_cache, v_cache, final_norm[0], head, alive)


def spec_rounds(forward: ForwardCall, chain: EagleChain | None, rope: tuple[torch.Tensor, torch.Tensor],
                sequence: torch.Tensor, length: int, cached: int, fed: int, known: int, offset: int,
                features: torch.Tensor | None, k: int, depth: int, ngram: tuple[int, int] | None, remaining: int,
                context: int, chunk: int, stop_ids: Sequence[int],
                draft: tuple[tuple, int] | None = None, policy: torch.Tensor | None = None,
                taps: Sequence[int] = ()) -> SpecRounds:
    """Greedy speculative rounds in one call (``qd_spec_rounds``): prompt lookup (``ngram``:
    its largest and smallest tail) when it matches, else ``chain``'s EAGLE chain of at most
    ``depth`` (reading the target's final states, through its map if it has one); the target's
    pass (``forward``) over what its cache lacks (``sequence[cached:length]``) and the
    chain; the longest prefix it agrees with and its own next token, written into
    ``sequence`` (int64, contiguous, with room); the kept tokens' final states into
    ``features`` (by position, the drafter's ``fed`` / ``known`` / ``offset`` as
    ``EagleDrafter`` keeps them), after the states of the layers in ``taps`` (an EAGLE-3
    drafter's fused layers but the last: states after that many blocks, ascending), side
    by side. Or, with ``draft`` (:func:`chain_model`'s arguments and the draft model's
    cache length), that model's greedy chain. Until ``chunk`` tokens are
    settled, ``remaining`` (the token budget) or ``context`` is reached, a token of
    ``stop_ids`` is settled, or the drafter's cache is full. ``rope``: cos and signed sin
    from position 0, covering every position fed. ``policy``: the drafter's ``--draft-stop``
    state (float64, ``draft_stop.ROUNDS_STATE`` values: ``rounds_state``), updated in place;
    None: fixed. The same tokens and caches, bit for bit, as the engine's loop."""
    rounds_max = chunk + 1
    records = torch.empty(3 * rounds_max, dtype=torch.int64)
    state = torch.tensor([length, cached, fed, known, offset, 0 if draft is None else draft[1]], dtype=torch.int64)
    stops = torch.tensor(list(stop_ids), dtype=torch.int64) if stop_ids else None
    tap_ids = torch.tensor(list(taps), dtype=torch.int64)
    cos, sin = rope
    if chain is None:
        eagle = (None, 0.0, 0, None, None, 0.0, None, 0, 0, None, None, 0, 0, 0, None, 0.0, None, None, 0, None, None,
                 1)
    else:
        embed, scale, width, fc, norms, eps, linears, n_heads, n_kv_heads, head_dim = chain._model
        if (head_dim != forward._model[8] or (width != forward.hidden and not chain.maps)
                or chain._chunks != len(taps) + 1 or list(taps) != sorted(set(taps))
                or any(not 0 < layer < forward._model[2] for layer in taps)
                or (features is not None and features.shape[1] != chain._chunks * forward.hidden)):
            raise ValueError("spec_rounds: an EAGLE chain of the target's head size reading its final state, "
                             "after the states of the layers in taps (ascending, inside the model)")
        eagle = (embed, scale, width, fc, norms, eps, linears, n_heads, n_kv_heads, *chain._cache, *chain._head,
                 chain._feature.data_ptr(), chain._feature_in, chain._chunks)
    model = (None, 0, 0, None, 0.0, None, 0, 0, 1, None, None, None, None, 0, 0, 0, None, 0.0, None, None, 0) \
        if draft is None else draft[0][0]
    count = library().qd_spec_rounds(
        *forward._model, forward._keys, forward._values, *forward._cache,
        *forward._head, *eagle, *model, cos.data_ptr(), sin.data_ptr(), sequence.data_ptr(), state.data_ptr(),
        None if features is None else features.data_ptr(), 0 if features is None else features.shape[1],
        tap_ids.data_ptr() if taps else None, len(taps), k, depth,
        *(ngram or (0, 0)), remaining, context, chunk, None if stops is None else stops.data_ptr(),
        0 if stops is None else stops.numel(), None if policy is None else policy.data_ptr(), records.data_ptr(),
        rounds_max, torch.get_num_threads())
    done = count if count >= 0 else -1 - count
    flat = records[: 3 * done].tolist()
    rounds = [(flat[i], flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3)]
    _, cached, fed, known, _, drafted = state.tolist()
    return SpecRounds(rounds, cached, fed, known, drafted, count < 0)


def fused_layers(x: torch.Tensor) -> bool:
    """Whether a pass over ``x`` runs the fused layer ops (:func:`rms_norm`, :func:`attend`,
    :func:`silu_mul`): float32 inference on the CPU with the kernels built. Training (grad
    enabled), other dtypes and devices, and torch.compile keep PyTorch's ops."""
    # is_compiling first: while Dynamo traces, nothing after it is looked at (no graph break).
    return (not torch.compiler.is_compiling() and x.device.type == "cpu" and x.dtype == torch.float32
            and not torch.is_grad_enabled() and library() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x^2) + eps) * weight``, row by row
    (``weight`` None: a unit weight)."""
    x = x.contiguous()
    y = torch.empty_like(x)
    library().qd_rms_norm(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1],
                          None if weight is None else weight.data_ptr(), eps, y.data_ptr())
    return y


def argmax_rows(logits: torch.Tensor) -> list[int] | None:
    """``logits.argmax(dim=-1).tolist()`` for a float32 CPU tensor ``[..., V]`` (the first
    maximum of each row, the first NaN where there is one), by our kernel: torch's took
    ~100 us for a 13-token verify pass's logits over 8,192 ids. None where the kernels do
    not take it (another dtype or device, a tensor subclass, whose ops a raw read would
    bypass, or no kernels built): the caller uses torch."""
    if (type(logits) is not torch.Tensor or logits.dtype != torch.float32 or logits.device.type != "cpu"
            or logits.dim() == 0 or library() is None):
        return None
    rows = logits.reshape(-1, logits.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    library().qd_argmax_rows(rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), out.data_ptr())
    return out.tolist()


def chain_argmax(logits: torch.Tensor, ids: torch.Tensor | None, vocab: int) -> int:
    """The token a greedy chain (:func:`greedy_chain`, :class:`EagleChain`) takes from a head's
    ``logits`` ``[n]``: the id (``ids[j]`` names logit ``j``; None: ``j``) of the largest
    logit among ids below ``vocab``, the smaller id on a tie, a NaN above everything (a head
    of -inf: its smallest id; none counting: 0): ``torch.argmax`` over the logits spread
    into the vocabulary."""
    logits = logits.float().contiguous()
    table = None if ids is None else ids.to(torch.int64).contiguous()
    return library().qd_argmax_ids(logits.data_ptr(), logits.numel(), None if table is None else table.data_ptr(),
                                   vocab)


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """A gated MLP's activation: ``silu(gate) * up`` for ``h = [gate | up]`` on the last dimension."""
    h = h.contiguous()
    width = h.shape[-1] // 2
    y = h.new_empty(*h.shape[:-1], width)
    library().qd_silu_mul(h.data_ptr(), h.numel() // h.shape[-1], width, y.data_ptr())
    return y


def attend(qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, k_cache: torch.Tensor,
           v_cache: torch.Tensor, layer: int, row: int, slots: torch.Tensor | int, kv_len: int,
           mask: torch.Tensor | None, out: torch.Tensor, n_heads: int) -> None:
    """One row's attention in one call: rotate the queries and keys of ``qkv`` (``T`` rows of
    ``(H + 2 H_kv) * D``, q then k then v heads; ``rope``: cos and signed sin, ``T`` rows of
    ``D``, or None), store the keys and values in cache ``row`` of ``layer`` of ``k_cache`` /
    ``v_cache`` (``[layers, rows, H_kv, max_len, D]``, contiguous) at ``slots`` (``[T]``, or an
    int: consecutive from it), then write softmax(q k^T / sqrt(D) + mask) v over the first
    ``kv_len`` slots into ``out`` (``T`` rows of ``H * D``, contiguous). ``mask``: additive,
    ``T`` rows of ``kv_len`` (-inf hides a slot), or None: causal, each query sees the slots up
    to its own (a one-token step: all of them), as the causal mask would show them, bit for bit.
    Leading dimensions of size 1 are fine everywhere: the caller passes its tensors as they
    are, without the views that would cost more than the arithmetic here."""
    args, _alive = _attention_args(n_heads, rope, k_cache, v_cache, layer, row, slots, kv_len, mask)
    qkv = qkv.contiguous()
    library().qd_attend(qkv.data_ptr(), qkv.numel() // qkv.shape[-1], *args, out.data_ptr(), torch.get_num_threads())


def half_cache(k_cache: torch.Tensor) -> int:
    """1 for a float16 KV cache (``--kv-cache float16``), 0 for float32: the two the kernels
    store and read; anything else is refused before a pointer is passed."""
    if k_cache.dtype not in (torch.float32, torch.float16):
        raise ValueError(f"the CPU kernels take a float32 or float16 KV cache, not {k_cache.dtype}")
    return int(k_cache.dtype == torch.float16)


def _attention_args(n_heads: int, rope: tuple[torch.Tensor, torch.Tensor] | None, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, layer: int, row: int, slots: torch.Tensor | int, kv_len: int,
                    mask: torch.Tensor | None) -> tuple[tuple, list[torch.Tensor]]:
    """The arguments ``qd_attend`` and ``qd_block`` share (heads, head size, RoPE tables,
    cache row, slots, mask), and the tensors they point into: the caller holds those until
    the call returns."""
    _, _, n_kv_heads, max_len, head_dim = k_cache.shape
    keep = []
    cos = sin = None
    if rope is not None:
        cos, sin = (t.contiguous() for t in rope)
        keep += [cos, sin]
    slot_ids = None if isinstance(slots, int) else slots.to(torch.int64).contiguous()
    if slot_ids is not None:
        keep.append(slot_ids)
    if mask is not None:
        mask = mask.contiguous()
        keep.append(mask)
    offset = (layer * k_cache.shape[1] + row) * n_kv_heads * max_len * head_dim * k_cache.element_size()
    args = (n_heads, n_kv_heads, head_dim, None if cos is None else cos.data_ptr(),
            None if sin is None else sin.data_ptr(), k_cache.data_ptr() + offset, v_cache.data_ptr() + offset,
            max_len, half_cache(k_cache), None if slot_ids is None else slot_ids.data_ptr(), slots if slot_ids is None else 0, kv_len,
            None if mask is None else mask.data_ptr(), 0 if mask is None else mask.shape[-1])
    return args, keep
