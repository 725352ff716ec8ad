"""Count forward calls of a transformers model (its target passes or draft steps), for the
transformers rows whose ``generate()`` does not report them."""

from __future__ import annotations


class CallCounter:
    """Counts the forward calls of ``module`` from now on (a forward hook)."""

    def __init__(self, module) -> None:
        self.calls = 0
        self._handle = module.register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        self.calls += 1

    def remove(self) -> None:
        """Stop counting."""
        self._handle.remove()
