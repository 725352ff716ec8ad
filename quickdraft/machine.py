"""What machine a measurement ran on: one description for training runs and benchmarks."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``), else the machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(placement) -> dict:
    """The device and dtype a measurement ran on (a GPU: its name, memory and CUDA version),
    and a KV cache stored narrower than the dtype."""
    import torch

    info = {"device": str(placement.device), "dtype": str(placement.dtype).removeprefix("torch.")}
    if getattr(placement, "kv_dtype", None) is not None:  # --kv-cache float16
        info["kv_cache"] = placement.kv_cache
    if placement.device.type == "cuda":
        props = torch.cuda.get_device_properties(placement.device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return info


def machine_info(threads: int | None = None) -> dict:
    """Platform, CPU, thread count and library versions.

    ``threads``: the torch thread count the measurement uses (default: torch's current one).
    """
    import torch
    import transformers

    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": threads or torch.get_num_threads(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
