"""Benchmarks (``quickdraft bench``): they measure and report; the runtime's decisions (cost
model, k, method choice) live in :mod:`quickdraft.policy`.

- :mod:`.prompts`    the JSONL prompt format and the built-in prompt categories
- :mod:`.prompt_sets` building the categories' stored files (short, long, out-of-domain)
- :mod:`.config`     settings of a run, their defaults (full, ``--quick``) and checks, and
  the table of method names (:data:`.config.BENCH_METHODS`)
- :mod:`.context`    what the rows share: models, tokenizer, EOS ids, prompt token ids
- :mod:`.methods`    the rows: our decode loop with a drafter, transformers' ``generate()``
- :mod:`.registry`   the built-in methods' rows (``register_method`` adds one)
- :mod:`.call_counter` forward calls of a transformers model
- :mod:`.results`    runs -> row summaries, and their definitions
- :mod:`.runner`     the measurement loop
- :mod:`.batch`      the batched benchmark (``--batch-size``)
- :mod:`.report`     rich tables (per category, then over all), JSON, Markdown
- :mod:`.plots`      PNG plots
- :mod:`.cli`        ``add_bench_parser`` / ``run_bench``
"""

from . import registry  # noqa: F401  (registers the built-in methods in config.BENCH_METHODS)
