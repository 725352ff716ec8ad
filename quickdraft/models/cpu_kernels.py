"""Our own AVX2 weight-only int8 / int4 matrix products (``kernels/qmatmul.c``).

PyTorch's CPU int8 and int4 kernels are vectorized for AVX-512 only; on AVX2 they run
scalar code, slower than the float32 product they would replace. ``qmatmul.c`` is a small
C file (two functions, no dependencies) compiled once per machine with the system C
compiler into ``$XDG_CACHE_HOME/quickdraft/kernels/`` and called through ``ctypes``; the
compiled library is keyed by the source's hash and the compiler flags. Where there is no
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
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("kernels") / "qmatmul.c"
# -ffp-contract=off: the compiler must not fuse or reorder float operations differently in
# the row-count specializations, so every row rounds alike (see the source's comment).
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared")
_c_int64, _ptr = ctypes.c_int64, ctypes.c_void_p


def _cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "quickdraft" / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(compiler: str) -> Path:
    """Compile the source once per (source, flags, compiler); concurrent builds are safe
    (each writes a private file, then renames it into place)."""
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join((compiler, *FLAGS)).encode()).hexdigest()[:16]
    target = _cache_root() / f"qmatmul-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp], check=True, capture_output=True, text=True)
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
    lib.qd_q8_matmul.argtypes = [_ptr, _c_int64, _c_int64, _ptr, _ptr, _c_int64, _ptr, ctypes.c_int]
    lib.qd_q4_matmul.argtypes = [_ptr, _c_int64, _c_int64, _ptr, _ptr, _ptr, _c_int64, _ptr, ctypes.c_int]
    lib.qd_q8_matmul.restype = lib.qd_q4_matmul.restype = None
    return lib


def q8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` with ``W = q * scale`` group by group: ``x`` float32 ``[M, K]``, ``q`` int8
    ``[N, K]``, ``scale`` float32 ``[N, K / 32]``; all contiguous. Needs :func:`library`."""
    lib = library()
    assert lib is not None, "q8_matmul needs the compiled kernels (cpu_kernels.library())"
    x = x.contiguous()
    y = torch.empty(x.shape[0], q.shape[0], dtype=torch.float32)
    lib.qd_q8_matmul(x.data_ptr(), x.shape[0], x.shape[1], q.data_ptr(), scale.data_ptr(), q.shape[0],
                     y.data_ptr(), torch.get_num_threads())
    return y


def q4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` with ``W = (q - 8) * scale + zero`` group by group, ``q`` as
    :func:`pack_q4` lays it out (``[N, K / 2]`` uint8); ``scale``, ``zero``: ``[N, K / 32]``."""
    lib = library()
    assert lib is not None, "q4_matmul needs the compiled kernels (cpu_kernels.library())"
    x = x.contiguous()
    y = torch.empty(x.shape[0], packed.shape[0], dtype=torch.float32)
    lib.qd_q4_matmul(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), scale.data_ptr(), zero.data_ptr(),
                     packed.shape[0], y.data_ptr(), torch.get_num_threads())
    return y


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` integers in 0..15 -> ``[N, K / 2]`` uint8 in GGUF's block layout: in each
    group of 32, byte ``j`` holds ``q[j]`` (low nibble) and ``q[j + 16]`` (high nibble)."""
    n, k = q.shape
    groups = q.to(torch.uint8).reshape(n, k // 32, 2, 16)
    return (groups[:, :, 0] | (groups[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
