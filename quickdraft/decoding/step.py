"""The per-row part of every decode step, shared by the single-sequence loop
(:func:`~quickdraft.decoding.engine.decode`) and the batched one
(:class:`~quickdraft.decoding.batch_engine.BatchEngine`): the prompt check, how many
tokens a row may draft, and emitting the tokens a verify pass settled. Both loops call
these, so a row stops, counts and clamps the same way at batch 1 and in a batch."""

from __future__ import annotations

import torch

from .stats import GenerationStats
from .stopping import StopConditions


class ContextOverflowError(ValueError):
    """The prompt does not fit in the model's context window."""


def check_prompt(prompt: torch.Tensor, context: int) -> torch.Tensor:
    """``prompt`` as a flat ``long`` tensor; a one-line error when it is empty or leaves no
    room in a context of ``context`` tokens."""
    prompt = prompt.to(torch.long).view(-1)
    if prompt.numel() == 0:
        raise ValueError("the prompt is empty; give at least one token")
    if prompt.numel() >= context:
        raise ContextOverflowError(
            f"the prompt has {prompt.numel()} tokens but the model's context is {context}; "
            "shorten it or truncate it"
        )
    return prompt


def draft_budget(k: int, stop: StopConditions, length: int, context: int) -> int:
    """Tokens a row may draft this step: never past its token budget or the context, since
    a step emits up to k + 1 tokens."""
    return max(0, min(k, stop.max_new_tokens - stop.count - 1, context - length - 1))


def emit(tokens: list[int], stop: StopConditions, sequence: torch.Tensor, length: int, context: int,
         stats: GenerationStats) -> tuple[list[int], str | None]:
    """Emit the tokens a verify pass settled (accepted drafts, then the target's own token)
    after the first ``length`` tokens of ``sequence``: up to the first EOS (not emitted) or
    stop condition. Writes them into ``sequence`` and counts them in ``stats``. Returns the
    emitted tokens and the finish reason: "stop", "length" (budget or context) or None."""
    emitted: list[int] = []
    finish = None
    for token in tokens:
        if stop.is_eos(token):
            finish = "stop"
            break
        emitted.append(token)
        finish = stop.check(token)
        if finish:
            break
    sequence[length : length + len(emitted)] = torch.tensor(emitted, dtype=torch.long)
    stats.new_tokens += len(emitted)
    if finish is None and length + len(emitted) >= context:
        finish = "length"
    return emitted, finish
