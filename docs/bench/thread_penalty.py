"""Decode-linear products from the main thread vs another thread (why `quickdraft serve`
steps in the main thread).

    python docs/bench/thread_penalty.py

Times a one-row decode-linear product of the embedded target's MLP shape (``DecodeLinear``:
our OpenMP float32 kernel where it compiles, oneDNN elsewhere), the
same product with MKL (``x @ W``), and one decode step of the embedded target, first in
the main thread and then in a second thread. On the 2-core development machine the
oneDNN product took 59 us from the main thread and 112 us from the other; MKL did not
slow down. With our kernel (session 20): 38.6 us and 94.2 us, a step 3.0 and 4.3 ms: the
penalty is OpenMP's, not oneDNN's alone.
"""

from __future__ import annotations

import statistics
import threading
import time

import torch
from torch import nn

from quickdraft.models.decode_linear import DecodeLinear
from quickdraft.models.lm import load_model


def per_call_us(fn, calls: int = 500, rounds: int = 5) -> float:
    for _ in range(50):
        fn()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(2)
    linear = nn.Linear(448, 2432, bias=False)
    onednn, weight_t = DecodeLinear(linear), linear.weight.detach().t().contiguous()
    x = torch.randn(1, 448)
    target = load_model("qd-stdlib-target")
    target.reset(256)
    target.extend(torch.randint(0, 8000, (128,)), logits="none")
    token = torch.tensor([5])

    def step() -> None:
        target.extend(token, logits="last")
        target.crop(128)

    def report(where: str) -> None:
        with torch.inference_mode():
            print(f"{where:12s} decode linear 1x448x2432 {per_call_us(lambda: onednn(x)):7.1f} us   "
                  f"MKL {per_call_us(lambda: x @ weight_t):7.1f} us   "
                  f"target step {per_call_us(step, calls=50) / 1000:6.2f} ms", flush=True)

    report("main thread")
    other = threading.Thread(target=report, args=("other thread",))
    other.start()
    other.join()


if __name__ == "__main__":
    main()
