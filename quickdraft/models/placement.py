"""Where a model runs and in what precision: THE one place device, dtype and weight
quantization are chosen.

The CLI's ``--device`` / ``--dtype`` / ``--quantize``, the Python API's ``placement=`` and
the server all resolve to a :class:`Placement`; loading puts the weights there, and everything built
from a model (KV caches, RoPE tables, drafters' state, hidden-state handoffs) follows
its weights. Acceptance-rule probabilities are computed in float32 whatever the dtype
(``decoding/sampling.warp_logits``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: ``--dtype`` names -> torch dtypes. ``auto``: float32 on CPU, bfloat16 on CUDA.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
DTYPE_CHOICES = ("auto", *DTYPES)
#: ``--kv-cache``: auto keeps keys and values in the compute dtype; float16 stores them in
#: 16 bits (CPU, float32 compute), as llama.cpp's default cache does.
KV_CACHE_CHOICES = ("auto", "float16")


class PlacementError(ValueError):
    """A device or dtype that cannot be used here; the message is one line with the fix."""


@dataclass(frozen=True)
class Placement:
    """A device, a compute dtype (default: CPU, float32), how the weights of the
    transformer blocks are stored (``quantize``, one of ``quant_linear.QUANTIZE_CHOICES``)
    and how the KV cache stores keys and values (``kv_cache``, one of
    :data:`KV_CACHE_CHOICES`)."""

    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    quantize: str = "auto"
    kv_cache: str = "auto"

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def kv_dtype(self) -> torch.dtype | None:
        """The KV cache's storage dtype, None for the compute dtype."""
        return torch.float16 if self.kv_cache == "float16" else None

    def describe(self) -> str:
        text = f"{self.device} {str(self.dtype).removeprefix('torch.')}"
        text = text if self.quantize in ("auto", "none") else f"{text} {self.quantize}"
        return text if self.kv_dtype is None else f"{text}, {self.kv_cache} KV cache"


def resolve_device(name: str | torch.device | None = None) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N`` (None: cpu), checked against this machine."""
    text = "cpu" if name is None else str(name).strip().lower()
    if text == "cuda":
        text = "cuda:0"
    if text != "cpu" and not (text.startswith("cuda:") and text[5:].isdigit()):
        raise PlacementError(f"--device {name!r} is not a torch device; use cpu, cuda or cuda:N")
    device = torch.device(text)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise PlacementError(
                f"--device {name}: no CUDA device is usable here (torch {torch.__version__}, {build}); "
                "use --device cpu, or install a CUDA build (make install TORCH_INDEX="
                "https://download.pytorch.org/whl/cu128) on a machine with an NVIDIA GPU"
            )
        count = torch.cuda.device_count()
        if device.index >= count:
            raise PlacementError(f"--device {name}: this machine has {count} CUDA device(s), "
                                 f"cuda:0 .. cuda:{count - 1}")
    return device


def resolve_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``float32``, ``bfloat16``, ``float16`` (or fp32 / bf16 / fp16) or ``auto`` / None:
    float32 on CPU, bfloat16 on CUDA."""
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise PlacementError(f"unsupported dtype {name}; use {', '.join(DTYPE_CHOICES)}")
        return name
    text = "auto" if name is None else DTYPE_ALIASES.get(str(name).strip().lower(), str(name).strip().lower())
    if text == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if text not in DTYPES:
        raise PlacementError(f"unknown dtype {name!r}; use {', '.join(DTYPE_CHOICES)}")
    return DTYPES[text]


def resolve_placement(device: str | torch.device | None = None,
                      dtype: str | torch.dtype | None = None, quantize: str | None = None,
                      kv_cache: str | None = None) -> Placement:
    """The :class:`Placement` for a ``--device``, ``--dtype``, ``--quantize`` and
    ``--kv-cache`` (see their resolvers); :class:`PlacementError` (one line, with the fix)
    for one that cannot be used here."""
    dev = resolve_device(device)
    dtype = resolve_dtype(dtype, dev)
    return Placement(dev, dtype, resolve_quantize(quantize, dev, dtype), resolve_kv_cache(kv_cache, dev, dtype))


def resolve_kv_cache(name: str | None, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` (None) or ``float16``, checked against the device and dtype: a float16
    cache is for float32 compute on the CPU (on CUDA the default bfloat16 cache is 16 bits
    already)."""
    text = "auto" if name is None else DTYPE_ALIASES.get(str(name).strip().lower(), str(name).strip().lower())
    if text not in KV_CACHE_CHOICES:
        raise PlacementError(f"unknown --kv-cache {name!r}; use {', '.join(KV_CACHE_CHOICES)}")
    if text == "float16" and device.type != "cpu":
        raise PlacementError("--kv-cache float16 is for the CPU (on CUDA the cache follows --dtype: pass "
                             "--dtype float16 or bfloat16 instead)")
    if text == "float16" and dtype != torch.float32:
        raise PlacementError(f"--kv-cache float16 stores a float32 model's cache; with --dtype "
                             f"{str(dtype).removeprefix('torch.')} the cache is 16-bit already (drop --kv-cache)")
    return text


def resolve_quantize(name: str | None, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` (None), ``none``, ``int8`` or ``int4``, checked against the device and dtype:
    the int8/int4 kernels are PyTorch's CPU ones and take float32 activations."""
    from .quant_linear import QUANTIZE_CHOICES, kernels_available

    text = "auto" if name is None else str(name).strip().lower()
    if text not in QUANTIZE_CHOICES:
        raise PlacementError(f"unknown --quantize {name!r}; use {', '.join(QUANTIZE_CHOICES)}")
    if text not in ("int8", "int4"):
        return text
    if device.type != "cpu":
        raise PlacementError(f"--quantize {text} runs on the CPU only (PyTorch's CPU kernels); "
                             "use --device cpu, or drop --quantize")
    if dtype != torch.float32:
        raise PlacementError(f"--quantize {text} computes in float32; drop --dtype or pass --dtype float32")
    if not kernels_available():
        raise PlacementError(f"--quantize {text}: this PyTorch build (torch {torch.__version__}) lacks the CPU "
                             "int4/int8 weight-only kernels; drop --quantize or install torch >= 2.6")
    return text


def model_placement(module: torch.nn.Module) -> Placement:
    """Where ``module``'s weights are (the first parameter's device and dtype)."""
    weight = next(module.parameters())
    return Placement(weight.device, weight.dtype)
