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


def test_draws_follow_the_distribution_and_never_pick_a_zero():
    """The inverse-CDF draw samples what torch.multinomial would: frequencies within a
    chi-square bound, no id of zero probability, a fixed seed the same ids."""
    from scipy.stats import chisquare

    from quickdraft.decoding.sampling import draw

    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.25, 0.05, 0.0])
    ids = draw(probs, 100_000, torch.Generator().manual_seed(1))
    counts = torch.bincount(ids, minlength=probs.numel())
    assert counts[probs == 0].sum() == 0
    mass = probs > 0
    assert chisquare(counts[mass].numpy(), probs[mass].numpy() * 100_000).pvalue > 1e-4
    assert torch.equal(draw(probs, 50, torch.Generator().manual_seed(3)), draw(probs, 50, torch.Generator().manual_seed(3)))
    skewed = draw(torch.tensor([0.0, 0.0, 0.0, 1.0]), 200, torch.Generator().manual_seed(0))  # a unnormalised one
    assert (skewed == 3).all()


def test_a_uniform_that_rounds_up_to_the_total_takes_the_last_id_with_mass(monkeypatch):
    from quickdraft.decoding import sampling

    monkeypatch.setattr(sampling.torch, "rand", lambda n, **kw: torch.ones(n, dtype=kw["dtype"]))
    assert sampling.draw(torch.tensor([0.2, 0.8, 0.0, 0.0]), 3, torch.Generator()).tolist() == [1, 1, 1]
