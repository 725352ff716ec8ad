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


EMPTY_PROMPT = "the prompt is empty; give at least one token"


def check_prompt(prompt: torch.Tensor, context: int, vocab_size: int) -> torch.Tensor:
    """``prompt`` as a flat ``long`` tensor; a one-line error when it is empty, holds an id
    outside the vocabulary or leaves no room in a context of ``context`` tokens."""
    prompt = prompt.to(torch.long).view(-1)
    if prompt.numel() == 0:
        raise ValueError(EMPTY_PROMPT)
    # The native kernels index the embedding unchecked: an id out of range would crash
    # the process (or, from Python, raise torch's bare "index out of range in self").
    low, high = int(prompt.min()), int(prompt.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"token id {low if low < 0 else high} is outside the model's vocabulary "
                         f"[0, {vocab_size}); pass ids from its tokenizer")
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


def emit(tokens: list[int], drafted: int, accepted: int, stop: StopConditions, sequence: torch.Tensor,
         length: int, context: int, stats: GenerationStats, passes: int = 1) -> tuple[list[int], str | None]:
    """Emit what a verify pass settled: ``tokens`` are its ``accepted`` draft tokens (of
    ``drafted`` proposed) and then the target's own token. They go out up to the first EOS
    (not emitted) or stop condition, into ``sequence`` after its first ``length`` tokens.

    The pass (``passes``: a plain greedy chain's, one a token) is recorded in ``stats``
    once the stop conditions have cut it, so accepted drafts that never reach the output
    (after EOS or a stop string) are not counted as accepted; on the last step
    ``stats.finish_reason`` and ``stats.stopped_by`` are set.
    Returns the emitted tokens and the finish reason: "stop", "length" (budget or
    context) or None."""
    emitted: list[int] = []
    finish = stopped_by = None
    for token in tokens:
        if stop.is_eos(token):
            finish, stopped_by = "stop", "eos"
            break
        emitted.append(token)
        finish = stop.check(token)
        if finish:
            stopped_by = "stop_string" if finish == "stop" else "max_new_tokens"
            break
    sequence[length : length + len(emitted)] = torch.tensor(emitted, dtype=torch.long)
    stats.record_step(drafted, accepted, len(emitted), passes)
    stats.new_tokens += len(emitted)
    if finish is None and length + len(emitted) >= context:
        finish, stopped_by = "length", "context"
    if finish:
        stats.finish_reason, stats.stopped_by = finish, stopped_by
    return emitted, finish


def accepted_states(states: dict[int, torch.Tensor], fed_before: int, path: list[int]) -> dict[int, torch.Tensor]:
    """The target's hidden states (``{layer: [fed, H]}`` of one verify pass) of the tokens it
    has now seen and kept: the ``fed_before`` tokens fed ahead of the proposal, then the
    accepted ``path`` nodes, in sequence order. A chain's are a prefix (a view, no copy)."""
    if path == list(range(len(path))):
        return {layer: state[: fed_before + len(path)] for layer, state in states.items()}
    rows = torch.tensor(list(range(fed_before)) + [fed_before + node for node in path], dtype=torch.long)
    if states:  # to the states' device without waiting for it
        rows = rows.to(next(iter(states.values())).device, non_blocking=True)
    return {layer: state[rows] for layer, state in states.items()}
