"""What a benchmark run does: its settings, their defaults (full and ``--quick``) and their
checks, in one place for the command line and the Python API.

Light on purpose (no torch): the CLI reads the defaults for its help texts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace

BACKENDS = ("auto", "native", "hf")
DEFAULT_METHODS = ("ar", "draft", "hf-ar", "hf-assisted")
MAX_K = 32
DEFAULT_THREADS = 2  # torch CPU threads
BASELINES = ("llama.cpp",)  # --baseline NAME adds these methods' rows
BASELINE_METHODS = {"llama.cpp": ("llama.cpp", "llama.cpp-spec")}
LLAMA_CPP_DRAFT_MAX = (4, 8, 12)  # llama.cpp-spec rows: its --spec-draft-n-max values


class BenchError(ValueError):
    """Bad benchmark input (unknown method, missing draft, ...); the message is one line."""


@dataclass(frozen=True)
class Preset:
    """The defaults of a full run and of a ``--quick`` one."""

    prompts: int | None  # prompts kept per category (None: all)
    max_new_tokens: int
    repeats: int
    sweep: tuple[int, ...]  # extra draft rows at these k


FULL = Preset(prompts=None, max_new_tokens=128, repeats=3, sweep=tuple(range(1, 9)))
QUICK = Preset(prompts=2, max_new_tokens=64, repeats=1, sweep=())


@dataclass
class BenchConfig:
    """Settings of one benchmark run (defaults: a full run; see :meth:`create`)."""

    model: str | None = None  # target (default: the embedded default)
    draft: str | None = None  # draft (default: the target's paired embedded draft)
    backend: str = "auto"  # auto = native when it supports the checkpoint, else transformers
    methods: Sequence[str] = DEFAULT_METHODS
    max_new_tokens: int = FULL.max_new_tokens
    repeats: int = FULL.repeats
    temperature: float = 0.0
    seed: int = 0
    k: int | None = None  # None: the cost model's choice from a calibration run
    sweep: Sequence[int] = field(default_factory=lambda: FULL.sweep)
    quick: bool = False
    threads: int | None = DEFAULT_THREADS  # None: leave torch's setting
    warmup_tokens: int = 32
    draft_vocab: int | None = None  # the draft's scored tokens: None its default, 0 all
    device: str = "cpu"  # cpu, cuda or cuda:N
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on CUDA
    llama_cpp: str | None = None  # directory of llama.cpp's binaries (the llama.cpp rows)
    llama_cpp_draft_max: Sequence[int] = LLAMA_CPP_DRAFT_MAX
    quantize: str = "auto"  # block linears: auto, none, int8, int4 (docs/quantization.md)
    kv_cache: str = "auto"  # auto (the compute dtype) or float16 keys and values

    def placement(self):
        """The resolved device and dtype (:class:`BenchError` for one this machine lacks)."""
        from ..models.placement import PlacementError, resolve_placement

        try:
            return resolve_placement(self.device, self.dtype, self.quantize, self.kv_cache)
        except PlacementError as exc:
            raise BenchError(str(exc)) from None

    @classmethod
    def create(cls, quick: bool = False, **given) -> BenchConfig:
        """A checked config: ``given`` settings (None = not given) over the defaults of a full
        or a ``quick`` run. Sweep rows are dropped when ``draft`` is not among the methods."""
        preset = QUICK if quick else FULL
        names = {f.name for f in fields(cls)}
        unknown = set(given) - names
        if unknown:
            raise TypeError(f"unknown benchmark setting {sorted(unknown)[0]!r}")
        values = {k: v for k, v in given.items() if v is not None}
        for name in ("max_new_tokens", "repeats", "sweep"):
            values.setdefault(name, getattr(preset, name))
        config = cls(quick=quick, **values)
        if "draft" not in config.methods:
            config = replace(config, sweep=())
        config.validate()
        return config

    def validate(self, known_methods: Sequence[str] | None = None) -> None:
        """Raise :class:`BenchError` (one line) for a setting that cannot run."""
        if known_methods is None:
            known_methods = tuple(BENCH_METHODS)
        if not self.methods:
            raise BenchError("no methods to run")
        unknown = [m for m in self.methods if m not in known_methods]
        if unknown:
            raise BenchError(f"unknown method {unknown[0]!r}; choose from: {', '.join(known_methods)}")
        if self.backend not in BACKENDS:
            raise BenchError(f"unknown backend {self.backend!r}; choose from: {', '.join(BACKENDS)}")
        if self.repeats < 1:
            raise BenchError(f"--repeats must be >= 1, got {self.repeats}")
        if self.max_new_tokens < 1:
            raise BenchError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise BenchError(f"--temperature must be >= 0, got {self.temperature}")
        if self.k is not None and not 1 <= self.k <= MAX_K:
            raise BenchError(f"-k must be between 1 and {MAX_K}, got {self.k}")
        if any(not 1 <= k <= MAX_K for k in self.sweep):
            raise BenchError(f"--sweep values must be between 1 and {MAX_K}")
        if self.draft_vocab is not None and self.draft_vocab < 0:
            raise BenchError(f"--draft-vocab must be >= 0 (0 = the whole vocabulary), got {self.draft_vocab}")
        if not self.llama_cpp_draft_max or any(not 1 <= k <= MAX_K for k in self.llama_cpp_draft_max):
            raise BenchError(f"--llama-cpp-draft-max values must be between 1 and {MAX_K}")
        if self.threads is not None and self.threads < 1:
            raise BenchError(f"--threads must be >= 1, got {self.threads}")
        self.placement()

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["methods"] = list(self.methods)
        d["sweep"] = list(self.sweep)
        d["llama_cpp_draft_max"] = list(self.llama_cpp_draft_max)
        return d


@dataclass(frozen=True)
class BenchMethod:
    """A registered method: its rows' factory and whether it needs the draft model."""

    name: str
    factory: Callable
    needs_draft: bool = False
    help: str = ""


BENCH_METHODS: dict[str, BenchMethod] = {}


def register_method(name: str, factory: Callable, *, needs_draft: bool | None = None,
                    help: str = "") -> None:
    """Make ``name`` a benchmark method whose rows ``factory(ctx, config, k)`` returns.
    ``needs_draft`` defaults to what the method table says for a decoding method's name
    (:data:`quickdraft.drafters.factory.METHODS`), else False."""
    from ..drafters.factory import NEEDS_DRAFT

    if needs_draft is None:
        needs_draft = name in NEEDS_DRAFT
    BENCH_METHODS[name] = BenchMethod(name, factory, needs_draft, help)


def needs_draft(methods: Sequence[str]) -> bool:
    """Whether any of these methods uses the draft model."""
    return any(BENCH_METHODS[m].needs_draft for m in methods if m in BENCH_METHODS)
