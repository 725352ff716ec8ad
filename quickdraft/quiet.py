"""Keep transformers' and huggingface_hub's chatter out of our output, only around our
own calls into them (library users' logging settings are restored afterwards)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Within the block: no progress bars ("Loading weights", "Writing model shards",
    downloads) and only errors from transformers' logger; warnings raised through Python's
    ``warnings`` by transformers are ignored. Everything is put back on exit."""
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    bars = logging.is_progress_bar_enabled()
    hub_bars_off = are_progress_bars_disabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    disable_progress_bars()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"transformers(\.|$)")
            yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()
        if not hub_bars_off:
            enable_progress_bars()
