"""Benchmarks (``quickdraft bench``), the speculative-decoding cost model and automatic k.

- :mod:`.cost_model` expected tokens per step, predicted speedup, best k (pure functions)
- :mod:`.autok`      step-cost timing and ``auto_k`` (calibrate briefly, let the model choose k)
- :mod:`.prompts`    the JSONL prompt format and the built-in prompt categories
- :mod:`.prompt_sets` building the categories' stored files (short, long, out-of-domain)
- :mod:`.config`     settings of a run, their defaults (full, ``--quick``) and checks
- :mod:`.context`    what the rows share: models, tokenizer, EOS ids, prompt token ids
- :mod:`.methods`    the rows: our decode loop with a drafter, transformers' ``generate()``
- :mod:`.registry`   method names -> rows (``register_method`` adds one)
- :mod:`.call_counter` forward calls of a transformers model
- :mod:`.results`    runs -> row summaries, and their definitions
- :mod:`.runner`     the measurement loop
- :mod:`.report`     rich tables (per category, then over all), JSON, Markdown
- :mod:`.plots`      PNG plots
- :mod:`.cli`        ``add_bench_parser`` / ``run_bench``
"""

from ..policy.cost_model import (
    StepCosts,
    best_k,
    choose_k,
    expected_tokens_from_acceptance,
    expected_tokens_per_step,
    predicted_speedup,
)

__all__ = [
    "StepCosts",
    "add_bench_parser",
    "auto_k",
    "best_k",
    "choose_k",
    "expected_tokens_from_acceptance",
    "expected_tokens_per_step",
    "predicted_speedup",
    "run_bench",
]


def __getattr__(name):  # torch-heavy parts load lazily
    if name == "auto_k":
        from ..policy.autok import auto_k

        return auto_k
    if name in ("add_bench_parser", "run_bench"):
        from . import cli

        return getattr(cli, name)
    raise AttributeError(name)
