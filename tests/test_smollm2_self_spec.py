"""Self-speculation shipped for SmolLM2-135M-Instruct: its exit head and its layer-skip
profile are found for it by default, and their greedy output equals plain decoding.
Skipped when the model is not installed (CI does not download it; ``make real-model``)."""

from __future__ import annotations

import pytest
import torch
from smollm2 import NEEDS_SMOLLM2

from quickdraft.decoding.engine import decode
from quickdraft.decoding.stopping import StopConditions

pytestmark = NEEDS_SMOLLM2


def tokens(target, prompt, drafter, k):
    out = []
    for step in decode(target, prompt, StopConditions(24, target.eos_token_ids), drafter=drafter,
                       num_speculative_tokens=k):
        out.extend(step.tokens)
    return out


@pytest.mark.slow
def test_shipped_head_and_profile_are_defaults_and_lossless():
    from quickdraft.drafters import DraftModelDrafter, NoDrafter
    from quickdraft.drafters.early_exit import EarlyExitDrafter, resolve_exit_head, shipped_head
    from quickdraft.drafters.layer_skip import LayerSkipLM, load_profile
    from quickdraft.pair import load_pair

    pair = load_pair("smollm2-135m", need_draft=False)
    target = pair.target
    head_dir = shipped_head(target)
    assert head_dir is not None and head_dir.name == "smollm2-135m-exit8x"
    head = resolve_exit_head(target, None, None)
    assert head.exit_layer == 8
    profile = load_profile(target)
    assert profile.skip_mlp and profile.n_layers == 30
    prompt = torch.tensor(pair.tokenizer("def is_prime(n):\n")["input_ids"])
    plain = tokens(target, prompt, NoDrafter(), 1)
    assert len(plain) == 24
    assert tokens(target, prompt, EarlyExitDrafter(target, head, share_kv=True), 3) == plain
    assert tokens(target, prompt, DraftModelDrafter(LayerSkipLM(target, profile), target.vocab_size), 2) == plain
