"""Where a model runs and in what precision: THE one place device and dtype are chosen.

The CLI's ``--device`` / ``--dtype``, the Python API's ``placement=`` and the server all
resolve to a :class:`Placement`; loading puts the weights there, and everything built
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


class PlacementError(ValueError):
    """A device or dtype that cannot be used here; the message is one line with the fix."""


@dataclass(frozen=True)
class Placement:
    """A device and a compute dtype (default: CPU, float32)."""

    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def describe(self) -> str:
        return f"{self.device} {str(self.dtype).removeprefix('torch.')}"


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
                      dtype: str | torch.dtype | None = None) -> Placement:
    """The :class:`Placement` for a ``--device`` and ``--dtype`` (see their resolvers);
    :class:`PlacementError` (one line, with the fix) for one that cannot be used here."""
    dev = resolve_device(device)
    return Placement(dev, resolve_dtype(dtype, dev))


def model_placement(module: torch.nn.Module) -> Placement:
    """Where ``module``'s weights are (the first parameter's device and dtype)."""
    weight = next(module.parameters())
    return Placement(weight.device, weight.dtype)
