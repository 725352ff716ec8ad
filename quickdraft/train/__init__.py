"""Training the embedded model family (``quickdraft train``).

- :mod:`.corpus`    the stdlib ``.py`` corpus, its deterministic split and manifest
- :mod:`.tokenizer` byte-level BPE (vocab 8192, ``<|endoftext|>``)
- :mod:`.data`      packed uint16 token streams and seeded window sampling
- :mod:`.presets`   model sizes and step budgets (``default``, ``tiny``)
- :mod:`.trainer`   training loop, distillation loss, checkpoints, evaluation, decode timing
- :mod:`.card`      model cards, registry metadata, loss curves
- :mod:`.pipeline`  the stages tokenizer -> target -> draft
- :mod:`.cli`       ``add_train_parser`` / ``run_train``
"""

__all__ = ["add_train_parser", "run_train"]


def __getattr__(name):  # lazy, so ``python -m quickdraft.train.cli`` imports cli only once
    if name in __all__:
        from . import cli

        return getattr(cli, name)
    raise AttributeError(name)
