"""Sampling is total: no temperature or top_p makes a distribution NaN, and a row whose
distribution still is one fails with SamplingError (its own, not the batch's)."""

from __future__ import annotations

import pytest
import torch

from quickdraft.decoding.sampling import (
    SamplingError,
    SamplingParams,
    choose,
    probabilities,
    sample,
)

LOGITS = torch.tensor([1.0, 3.0, -2.0, 2.5, 0.0]) * 10


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-6])
def test_a_tiny_temperature_is_greedy(temperature):
    """(Before: logits / 1e-40 overflowed to inf, then NaN, and torch.multinomial raised.)"""
    params = SamplingParams(temperature, seed=0)
    assert params.greedy
    assert choose(LOGITS, params, params.generator()) == (1, None)


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-9])
def test_top_p_always_keeps_the_top_token(top_p):
    """(Before: a top_p that is 0 in float32 dropped every token.)"""
    params = SamplingParams(1.0, top_p=top_p, seed=0)
    probs = probabilities(LOGITS, params)
    assert torch.equal(probs, torch.nn.functional.one_hot(torch.tensor(1), 5).float())
    assert choose(LOGITS, params, params.generator())[0] == 1


@pytest.mark.parametrize("probs", [torch.tensor([0.5, float("nan")]), torch.tensor([float("inf"), 0.0]),
                                   torch.zeros(2)], ids=["nan", "inf", "no-mass"])
def test_a_broken_distribution_is_a_sampling_error(probs):
    with pytest.raises(SamplingError):
        sample(probs, torch.Generator().manual_seed(0))
