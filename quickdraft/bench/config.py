"""What a benchmark run does: its settings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class BenchError(ValueError):
    """Bad benchmark input (unknown method, missing draft, ...); the message is one line."""


@dataclass
class BenchConfig:
    model: str | None = None
    draft: str | None = None
    methods: Sequence[str] = ("ar", "draft", "hf-ar", "hf-assisted")
    max_new_tokens: int = 128
    repeats: int = 3
    temperature: float = 0.0
    seed: int = 0
    k: int | None = None  # None: the cost model's choice from a calibration run
    sweep: Sequence[int] = ()  # extra draft rows at these k
    quick: bool = False
    threads: int | None = 2
    warmup_tokens: int = 32
    backend: str = "native"

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["methods"] = list(self.methods)
        d["sweep"] = list(self.sweep)
        return d
