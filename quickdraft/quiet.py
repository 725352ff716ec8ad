"""Keep transformers' and huggingface_hub's chatter out of our output, only around our
own calls into them (library users' logging settings are restored afterwards).

Importing transformers costs 1-2 s, and the native path (our tokenizer, our runtime) never
needs it, so :func:`quiet_transformers` does not import it: when it is not imported yet, the
settings are applied the moment something inside the block imports it."""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Within the block: no progress bars ("Loading weights", "Writing model shards",
    downloads) and only errors from transformers' logger; warnings raised through Python's
    ``warnings`` by transformers are ignored. Everything is put back on exit."""
    with contextlib.ExitStack() as stack, warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"transformers(\.|$)")
        if "transformers" in sys.modules:
            stack.enter_context(_quiet())
        else:
            hook = _AfterImport("transformers", lambda: stack.enter_context(_quiet()))
            sys.meta_path.insert(0, hook)
            stack.callback(hook.remove)
        yield


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
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
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()
        if not hub_bars_off:
            enable_progress_bars()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then()`` right after the package ``name`` is first imported (once)."""

    def __init__(self, name: str, then: Callable[[], object]) -> None:
        self.name, self.then = name, then

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        self.remove()  # the other finders locate it; we only wrap its execution
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader, exec_module = spec.loader, spec.loader.exec_module

        def exec_then(module) -> None:
            del loader.exec_module  # the loader's own method again
            exec_module(module)
            self.then()

        loader.exec_module = exec_then
        return spec
