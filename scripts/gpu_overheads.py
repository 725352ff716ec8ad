"""Where a batch-1 decode step's time goes on this machine, apart from reading weights.

The first H200 run (docs/gpu.md) found ~55-62 ms per step for both the 1B- and the
8B-shaped model, in our runtime and in transformers alike: a fixed cost, not the weight
read (3 ms for the 8B). This script separates the candidates, each in isolation:

- a host synchronisation (``torch.cuda.synchronize``) after one tiny kernel, and ``.item()``;
- launching many tiny kernels back to back (the launch cost per kernel);
- device-to-device copy bandwidth (the HBM figure a roofline assumes);
- one bf16 GEMV of an 8B MLP weight, timed by CUDA events (kernel time) and by the wall;
- one plain decode step of a random Llama-1B-shaped model under ``torch.profiler``: the
  ops with the most CPU and the most device time (at one key length, again and again);
- plain decode steps whose key length grows by one each step, as in generation, with
  torch's own choice of attention kernels and with the runtime's (no cuDNN attention:
  ``models/transformer.attention_kernels``). The first H100 run (2026-11-26) found the
  warmed fixed-length 1B step at 6.3 ms and a generation's step at ~60 ms, with
  ``_cudnn_attention_forward`` in the profile: cuDNN plans per key length.

    python scripts/gpu_overheads.py --out results/gpu/overheads.json           # on a GPU
    python scripts/gpu_overheads.py --device cpu --shape tiny --out /tmp/o.json  # smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_us(fn, device: torch.device, repeats: int) -> float:
    """Median wall time of ``fn`` (then a synchronisation), microseconds."""
    times = []
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        fn()
        sync(device)
        times.append(1e6 * (time.perf_counter() - started))
    return statistics.median(times)


def sync_costs(device: torch.device, repeats: int) -> dict:
    x = torch.zeros(1, device=device)
    empty = wall_us(lambda: None, device, repeats)  # a synchronisation with nothing queued
    one_kernel = wall_us(lambda: x.add_(1), device, repeats)
    item = statistics.median(
        [wall_us(lambda: x.add_(1).item(), device, 1) for _ in range(repeats)])
    return {"sync_empty_us": empty, "one_kernel_then_sync_us": one_kernel, "kernel_then_item_us": item}


def launch_cost(device: torch.device, kernels: int = 2000) -> dict:
    x = torch.zeros(1, device=device)

    def burst():
        for _ in range(kernels):
            x.add_(1)

    burst()  # warm
    sync(device)
    started = time.perf_counter()
    burst()
    enqueued = time.perf_counter() - started  # the host's side: launches only
    sync(device)
    total = time.perf_counter() - started
    return {"kernels": kernels, "launch_us_per_kernel": 1e6 * enqueued / kernels,
            "wall_us_per_kernel": 1e6 * total / kernels}


def copy_bandwidth(device: torch.device, dtype: torch.dtype, mib: int) -> dict:
    src = torch.empty(mib * 2**20 // torch.finfo(dtype).bits * 8, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    us = wall_us(lambda: dst.copy_(src), device, 10)
    nbytes = 2 * src.numel() * src.element_size()  # read and written
    return {"mib": mib, "us": us, "bytes_per_s_read_plus_write": nbytes / (us / 1e6)}


def gemv(device: torch.device, dtype: torch.dtype, rows: int, cols: int) -> dict:
    w = torch.randn(rows, cols, dtype=dtype, device=device)
    x = torch.randn(1, cols, dtype=dtype, device=device)
    out = {"shape": [rows, cols], "weight_bytes": w.numel() * w.element_size(),
           "wall_us": wall_us(lambda: torch.nn.functional.linear(x, w), device, 50)}
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        kernel = []
        for _ in range(50):
            start.record()
            torch.nn.functional.linear(x, w)
            end.record()
            end.synchronize()
            kernel.append(1e3 * start.elapsed_time(end))
        out["kernel_us"] = statistics.median(kernel)
        out["kernel_bytes_per_s"] = out["weight_bytes"] / (out["kernel_us"] / 1e6)
    return out


def profiled_step(shape: str, device: torch.device, dtype: torch.dtype, top: int) -> dict:
    """One plain decode step of a random model of ``shape`` (scripts/gpu_roofline.py's
    shapes), timed, then profiled."""
    import gpu_roofline  # this folder's script: the same shapes and the same loading path

    hf = gpu_roofline.hf_model(shape, device, dtype)
    target = gpu_roofline.native_from(hf, device, dtype)
    del hf
    prompt = torch.randint(0, gpu_roofline.SHAPES[shape]["vocab_size"], (64,))
    target.reset(256)
    target.extend(prompt, logits="none")
    token = prompt[-1:]

    def step():
        target.extend(token, logits=1).argmax(-1).item()  # what a greedy step waits for
        target.crop(target.length - 1)

    step()
    result = {"shape": shape, "step_wall_us": wall_us(step, device, 20)}
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(5):
            step()
    events = prof.key_averages()
    device_attr = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"

    def rows(attr: str) -> list[dict]:
        ranked = sorted(events, key=lambda e: getattr(e, attr, 0), reverse=True)[:top]
        return [{"op": e.key, "calls": e.count // 5, "self_cpu_us_per_step": e.self_cpu_time_total / 5,
                 "self_device_us_per_step": getattr(e, device_attr, 0) / 5} for e in ranked]

    result["top_by_cpu"] = rows("self_cpu_time_total")
    if device.type == "cuda":
        result["top_by_device"] = rows(device_attr)
    result["ops_per_step"] = sum(e.count for e in events) // 5
    return result


def growing_steps(shape: str, device: torch.device, dtype: torch.dtype, steps: int = 48) -> dict:
    """Median wall ms of a greedy decode step as the key length grows (a new length each
    step), with torch's default attention kernels and with the runtime's choice."""
    import gpu_roofline
    from torch.nn.attention import SDPBackend

    from quickdraft.models import transformer

    hf = gpu_roofline.hf_model(shape, device, dtype)
    target = gpu_roofline.native_from(hf, device, dtype)
    del hf
    prompt = torch.randint(0, gpu_roofline.SHAPES[shape]["vocab_size"], (64,))
    ours = transformer.EAGER_CUDA_ATTENTION
    every = ours + [SDPBackend.CUDNN_ATTENTION]  # all enabled: torch's own priority decides
    result = {"shape": shape, "steps": steps}
    for name, kernels in (("torch_default", every), ("quickdraft", ours), ("torch_default_again", every)):
        transformer.EAGER_CUDA_ATTENTION = kernels
        try:
            target.reset(64 + steps + 1)
            target.extend(prompt, logits="none")
            token, times = prompt[-1:], []
            for _ in range(steps):
                sync(device)
                started = time.perf_counter()
                token = target.extend(token, logits=1).argmax(-1).view(1).cpu()
                times.append(1e3 * (time.perf_counter() - started))
            result[f"{name}_step_ms"] = statistics.median(times)
        finally:
            transformer.EAGER_CUDA_ATTENTION = ours
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--shape", default="llama-1b", help="the profiled model (scripts/gpu_roofline.py)")
    parser.add_argument("--copy-mib", type=int, default=2048)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    result: dict = {"device": str(device), "dtype": args.dtype, "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    parts = [("sync", lambda: sync_costs(device, 50)), ("launch", lambda: launch_cost(device)),
             ("copy", lambda: copy_bandwidth(device, dtype, args.copy_mib)),
             ("gemv_8b_mlp", lambda: gemv(device, dtype, 14336, 4096)),
             ("step", lambda: profiled_step(args.shape, device, dtype, args.top)),
             ("growing", lambda: growing_steps(args.shape, device, dtype))]
    for name, fn in parts:
        try:
            result[name] = fn()
        except Exception as exc:  # one part failing keeps the others' figures
            result[name] = {"error": f"{type(exc).__name__}: {exc}"}
        out.write_text(json.dumps(result, indent=1))
        print(json.dumps({name: result[name]})[:2000], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
