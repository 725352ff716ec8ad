"""Preallocated key/value cache addressed by slot; lengths live with its users."""

from __future__ import annotations

import math

import torch

from .config import ModelConfig

#: Caches smaller than this are allocated without asking how much memory is free.
CHECK_ABOVE_BYTES = 256 << 20


class CacheTooLargeError(ValueError):
    """The preallocated cache would not fit in the memory that is free."""


def free_memory(device: torch.device) -> int | None:
    """Bytes that can be allocated on ``device`` now, where the platform says (Linux's
    MemAvailable, CUDA's free memory); None where it cannot tell."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


class KVCache:
    """Keys and values of every layer, preallocated for ``max_len`` slots per row.

    Shapes are static (``[n_layers, batch, n_kv_heads, max_len, head_dim]``): nothing is
    reallocated while decoding. The cache keeps no lengths of its own: the caller decides
    where each row writes (its ``slots``). Rolling back is just writing at a lower slot
    next time: stale slots beyond a row's length are never attended to (the default mask
    only lets a query see slots up to its own) and are overwritten by the next write.

    ``dtype`` is the dtype attention computes in (its masks are made in it); the keys and
    values may be stored narrower (``store_dtype``: ``--kv-cache float16`` keeps float32
    attention over float16 keys and values, half the bytes each step reads).
    """

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        store_dtype: torch.dtype | None = None,
    ) -> None:
        shape = (config.n_layers, batch_size, config.n_kv_heads, max_len, config.head_dim)
        need = 2 * math.prod(shape) * (store_dtype or dtype).itemsize
        if need > CHECK_ABOVE_BYTES:
            # Too large fails at best with a traceback, at worst zeroing it wakes the OOM killer.
            free = free_memory(torch.device(device))
            if free is not None and need > free:
                raise CacheTooLargeError(
                    f"the KV cache for {batch_size} rows of {max_len} positions needs {need / 2**30:.1f} GiB, "
                    f"{free / 2**30:.1f} GiB is free; decode fewer rows at once (serve --max-batch-size, "
                    "--batch-size)")
        self.k = torch.zeros(shape, dtype=store_dtype or dtype, device=device)
        self.v = torch.zeros(shape, dtype=store_dtype or dtype, device=device)
        self.max_len = max_len
        self.dtype = dtype

    def write(self, layer: int, rows: torch.Tensor | None, slots: torch.Tensor | int, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store ``k``/``v`` (``[B, H, T, D]``) of ``layer`` at ``slots`` (``[B, T]``) of cache
        ``rows`` (``[B, 1]``); an int ``slots`` ``s``: at slots ``s .. s + T - 1`` of rows
        ``0 .. B - 1`` (a plain slice copy: the common, contiguous case)."""
        if isinstance(slots, int):
            # narrow + copy_: two aten calls where indexing with a tuple makes five
            self.k[layer][: k.shape[0]].narrow(2, slots, k.shape[2]).copy_(k)
            self.v[layer][: v.shape[0]].narrow(2, slots, v.shape[2]).copy_(v)
            return
        # Advanced indices around a slice put the indexed dims first: target is [B, T, H, D].
        # (Index put does not cast as copy_ does: a narrower store needs its own dtype.)
        self.k[layer][rows, :, slots] = k.transpose(1, 2).to(self.k.dtype)
        self.v[layer][rows, :, slots] = v.transpose(1, 2).to(self.v.dtype)

    def layer(self, layer: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values ``[B, H, kv_len, D]`` of ``layer``'s first ``kv_len`` slots
        (views; widened copies in :attr:`dtype` where they are stored narrower)."""
        return self.widen(self.k[layer].narrow(2, 0, kv_len)), self.widen(self.v[layer].narrow(2, 0, kv_len))

    def widen(self, stored: torch.Tensor) -> torch.Tensor:
        """Keys or values read from the cache, in the dtype attention computes in."""
        return stored if stored.dtype == self.dtype else stored.to(self.dtype)

    # Inference mode: the cache may have been allocated inside it (an inference tensor),
    # which only inference mode may update in place.
    @torch.inference_mode()
    def move(self, src: torch.Tensor, dst: int, row: int = 0) -> None:
        """Copy the slots ``src`` of ``row`` (every layer) to ``dst .. dst + len(src) - 1``:
        compacts the accepted path of a token tree into place. Sources may overlap the
        destination (they are read before writing)."""
        end = dst + src.shape[0]
        self.k[:, row, :, dst:end] = self.k[:, row, :, src]
        self.v[:, row, :, dst:end] = self.v[:, row, :, src]


class _PerLayer:
    """Per-layer tensors indexed like one ``[n_layers, ...]`` tensor (``t[layer, ...]``)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> None:
        self.layers = [torch.zeros(shape[1:], dtype=dtype, device=device) for _ in range(shape[0])]
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, torch.device(device)

    def __getitem__(self, index):
        layer, *rest = index if isinstance(index, tuple) else (index,)
        return self.layers[layer][tuple(rest)]

    def __setitem__(self, index, value) -> None:
        layer, *rest = index
        self.layers[layer][tuple(rest)] = value


class TrainingKVCache(KVCache):
    """A cache for training passes from scratch: each layer's keys and values in a tensor of
    their own, so writing one layer does not invalidate (for autograd) what an earlier
    layer saved from its own; with one shared tensor, a model of two or more layers fails
    in backward."""

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        shape = (config.n_layers, batch_size, config.n_kv_heads, max_len, config.head_dim)
        self.k, self.v = _PerLayer(shape, dtype, device), _PerLayer(shape, dtype, device)
        self.max_len = max_len
        self.dtype = dtype
