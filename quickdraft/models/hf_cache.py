"""Calling a ``transformers`` causal LM with a KV cache under the argument name it takes.

transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns and goes
away in 5.40); older releases only know ``past_key_values``. Asking the model's own
``forward`` signature keeps every release in our range quiet and correct.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


def cache_argument(model: torch.nn.Module) -> str:
    """The keyword ``model.forward`` takes its KV cache under."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def forward_with_cache(model: torch.nn.Module, input_ids: torch.Tensor, cache: Any = None,
                       **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """One cached forward pass: ``(logits, cache)``; ``cache=None`` starts a new one."""
    if cache is not None:
        kwargs[cache_argument(model)] = cache
    out = model(input_ids=input_ids, use_cache=True, **kwargs)
    returned = out.get("cache") if "cache" in out else out.get("past_key_values")
    return out.logits, returned
