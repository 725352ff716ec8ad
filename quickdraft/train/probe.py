"""Acceptance while training: speculative decoding with the drafter being trained, on fixed
held-out prompts, every ``--probe-every`` steps.

The loss says how close the student is to the target; what a user gets is how many draft
tokens verification accepts. The probe measures that directly (greedy, through the same
decode loop as ``quickdraft generate``), so the curves of different drafters (a separate
draft, early exit, Medusa, ...) compare on the one axis that matters.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import torch

from ..decoding.drafter import Drafter
from ..decoding.engine import decode
from ..decoding.stats import GenerationStats
from ..decoding.stopping import StopConditions
from ..models.lm import CausalLM, NativeLM

PROMPTS = 4  # held-out windows per probe
PROMPT_TOKENS = 48
NEW_TOKENS = 32


def probe_prompts(stream: np.ndarray, n: int = PROMPTS, length: int = PROMPT_TOKENS) -> list[torch.Tensor]:
    """``n`` prompts of ``length`` tokens spread evenly over the held-out ``stream`` (the
    same ones at every probe, so the curve moves only with the drafter)."""
    if stream.size < length + 1:
        return []
    starts = np.linspace(0, stream.size - length - 1, n).astype(int)
    return [torch.as_tensor(stream[s : s + length], dtype=torch.long) for s in starts]


def snapshot(module: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of the student to draft with: drafters may swap in decode kernels or
    cache tables in inference mode, which the module still training must not see."""
    return copy.deepcopy(module).eval().requires_grad_(False)


def as_lm(model: torch.nn.Module) -> NativeLM:
    """A frozen native target for decoding, its training weights untouched (no CPU decode
    kernels: those replace the modules in place and have no backward)."""
    return NativeLM(model, decode_linears=False)


@torch.no_grad()
def acceptance_probe(target: CausalLM, drafter_of: Callable[[], Drafter], prompts: list[torch.Tensor],
                     k: int, new_tokens: int = NEW_TOKENS) -> dict[str, float]:
    """Greedy speculative decoding of ``prompts`` with a fresh ``drafter_of()`` each:
    ``mean_accepted_tokens`` (new tokens per target pass) and ``accept_rate/pos<i>`` (how
    often draft position i was accepted when drafted)."""
    total = GenerationStats()
    for prompt in prompts:
        stats = GenerationStats()
        for _ in decode(target, prompt, StopConditions(new_tokens), drafter_of(), num_speculative_tokens=k,
                        stats=stats):
            pass
        total.merge(stats)
    return {"mean_accepted_tokens": total.mean_accepted_tokens,
            **{f"accept_rate/pos{i + 1}": rate for i, rate in enumerate(total.per_position_acceptance)}}


def draft_probe(teacher: torch.nn.Module, heldout: np.ndarray) -> Callable[[torch.nn.Module], dict[str, float]]:
    """Acceptance of a transformers draft being trained against its transformers teacher,
    drafting chains of 4 (the ``--backend hf`` path: both are ``transformers`` models here)."""
    from ..drafters.draft_model import DraftModelDrafter
    from ..models.lm import HFCausalLM

    lm, prompts = HFCausalLM(teacher), probe_prompts(heldout)
    vocab = lm.vocab_size
    return lambda student: acceptance_probe(lm, lambda: DraftModelDrafter(HFCausalLM(student), vocab), prompts, k=4)
