"""The cost model against closed-form values (docs/methods.md, "Cost model")."""

import math

import pytest

from quickdraft.policy.cost_model import (
    StepCosts,
    best_k,
    choose_k,
    expected_tokens_from_acceptance,
    expected_tokens_per_step,
    extend_acceptance,
    predicted_speedup,
    speedup_curve,
    where_time_goes,
)


def leviathan_speedup(alpha: float, k: int, c: float) -> float:
    """The paper's closed form (T_verify = T_ar), the oracle for predicted_speedup."""
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))


def test_expected_tokens_closed_form():
    assert expected_tokens_per_step(0.8, 4) == pytest.approx(3.3616)
    assert round(expected_tokens_per_step(0.8, 4), 2) == 3.36
    assert expected_tokens_per_step(0.0, 5) == 1.0
    assert expected_tokens_per_step(1.0, 5) == 6.0
    assert expected_tokens_per_step(0.5, 0) == 1.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    with pytest.raises(ValueError):
        expected_tokens_per_step(1.5, 2)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 0.95])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_per_position_matches_iid(alpha, k):
    per_position = [alpha ** (i + 1) for i in range(k)]  # P(position i accepted)
    assert expected_tokens_from_acceptance(per_position) == pytest.approx(expected_tokens_per_step(alpha, k))


def test_tau_is_one_plus_sum_of_per_position_acceptance():
    assert expected_tokens_from_acceptance([0.9, 0.7, 0.4]) == pytest.approx(3.0)
    assert expected_tokens_from_acceptance([0.9, 0.7, 0.4], k=2) == pytest.approx(2.6)
    # extrapolation past the measured positions decays geometrically
    ext = extend_acceptance([0.8, 0.64], 4)
    assert ext == pytest.approx([0.8, 0.64, 0.512, 0.4096])
    # noise that makes a later position larger than an earlier one is clipped
    assert extend_acceptance([0.5, 0.6], 2) == [0.5, 0.5]


def test_predicted_speedup_closed_forms():
    costs = StepCosts(t_ar=1.0, t_draft=0.0)  # free draft, verify(n) = t_ar
    assert predicted_speedup(4, costs, alpha=0.8) == pytest.approx(3.3616)
    # Leviathan et al.: (1 - a^(k+1)) / ((1 - a)(k c + 1))
    costs = StepCosts(t_ar=10.0, t_draft=1.0)
    for k in (1, 3, 7):
        assert predicted_speedup(k, costs, alpha=0.7) == pytest.approx(leviathan_speedup(0.7, k, 0.1))
    # measured per-position acceptance takes precedence over alpha
    assert predicted_speedup(2, costs, alpha=0.0, per_position=[0.5, 0.25]) == pytest.approx(1.75 * 10 / 12)
    # the verify pass growing with n lowers the prediction
    slow = StepCosts(t_ar=10.0, t_draft=1.0, verify={5: 15.0})
    assert predicted_speedup(4, slow, alpha=0.8) == pytest.approx(3.3616 * 10 / (4 + 15))


def test_verify_interpolation():
    c = StepCosts(t_ar=1.0, t_draft=0.1, verify={1: 1.0, 3: 2.0, 5: 3.0})
    assert c.t_verify(1) == 1.0
    assert c.t_verify(2) == pytest.approx(1.5)
    assert c.t_verify(4) == pytest.approx(2.5)
    assert c.t_verify(7) == pytest.approx(4.0)  # extrapolated from the two largest
    assert StepCosts.from_dict(c.to_dict()).verify == c.verify


def test_best_k():
    # free draft and flat verify: more is always better
    assert best_k(StepCosts(t_ar=1.0, t_draft=0.0), alpha=0.9, max_k=16) == 16
    # brute force against the closed form
    costs = StepCosts(t_ar=1.0, t_draft=0.05)
    curve = {k: leviathan_speedup(0.8, k, 0.05) for k in range(1, 17)}
    assert best_k(costs, alpha=0.8) == max(curve, key=curve.get)
    assert speedup_curve(costs, alpha=0.8)[4] == pytest.approx(curve[4])
    # a draft as slow as the target never pays: choose_k says 0 (do not speculate)
    assert choose_k(StepCosts(t_ar=1.0, t_draft=1.0), alpha=0.3) == 0
    assert choose_k(costs, alpha=0.8) == best_k(costs, alpha=0.8)


def test_where_time_goes():
    costs = StepCosts(t_ar=0.010, t_draft=0.001, verify={5: 0.014})
    b = where_time_goes(costs, 4, measured_step_seconds=0.020)
    assert b["draft_seconds"] == pytest.approx(0.004)
    assert b["verify_seconds"] == pytest.approx(0.014)
    assert b["overhead_seconds"] == pytest.approx(0.002)
    assert math.isclose(sum(b["shares"].values()), 1.0)
