"""Sampled tree, multi-draft and n-gram verification is distributed exactly as the target.

Same statistical test as test_sampling_exact.py (chi-square of the first three tokens
against the enumerated target distribution, tiny vocabulary, seeded runs): the proposal
of the prefill pass is a depth-2 tree, so tokens 1-3 come out of tree acceptance, the
residual updates and the bonus token. Deliberately wrong rules fail the same test.
"""

import pytest
import torch
from test_sampling_exact import VOCAB, empirical_pvalue, tiny_lm

from quickdraft.decoding.sampling import SamplingParams
from quickdraft.decoding.verify import SpecTrSampling, SpeculativeSampling, residual_distribution
from quickdraft.drafters import DraftModelDrafter, NgramDrafter
from quickdraft.drafters.shapes import MultiDraft, StaticTree

TARGET = tiny_lm(0, 3.0)
N = 2000  # half of test_sampling_exact's runs: these cover more rules, the suite stays fast
T1 = SamplingParams(temperature=1.0)
WARPED = SamplingParams(temperature=0.8, top_k=4)


def drafter(shape):
    return DraftModelDrafter(tiny_lm(1, 3.0), VOCAB, shape)


class MSSWithoutResidualUpdate(SpeculativeSampling):
    """WRONG: after rejecting a child, try the next one (and sample at the end) from p itself."""

    def update(self, p, q):
        return p


class SpecTrRhoOneNoCorrection(SpecTrSampling):
    """WRONG: rho = 1 (accept with min(1, p/q) per draft) and the plain residual max(p - q, 0)."""

    @staticmethod
    def solve_rho(p, q, n, rounds=3):
        return 1.0

    def residual(self, p, q, rho, n):
        return residual_distribution(p, q)


@pytest.mark.slow
@pytest.mark.parametrize("shape,params", [
    (StaticTree((2, 2)), T1),                 # sampled children, merged duplicates
    (StaticTree((3, 1), sample=False), WARPED),  # top-k children: one-hot q
    (MultiDraft(3), T1),
], ids=["tree-sampled", "tree-top", "multi-draft-mss"])
def test_tree_sampling_matches_target_distribution(shape, params):
    assert empirical_pvalue(TARGET, drafter(shape), params, n_samples=N) > 1e-3


@pytest.mark.slow
def test_spectr_matches_target_distribution():
    assert empirical_pvalue(TARGET, drafter(MultiDraft(3)), T1, SpecTrSampling, n_samples=N) > 1e-3


@pytest.mark.slow
def test_ngram_sampling_matches_target_distribution():
    assert empirical_pvalue(TARGET, NgramDrafter(2, 1), T1, k=3, n_samples=N) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("shape,rule", [
    (StaticTree((2, 2)), MSSWithoutResidualUpdate),
    (MultiDraft(3), SpecTrRhoOneNoCorrection),
], ids=["mss-no-residual", "spectr-rho-1"])
def test_wrong_tree_rules_fail_the_same_test(shape, rule):
    # The bias is large: 500 runs give p ~ 1e-30 (1500 gave 1e-103 and 1e-88).
    assert empirical_pvalue(TARGET, drafter(shape), T1, rule, n_samples=500) < 1e-6


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_spectr_rho_solves_the_equation_and_keeps_the_residual_exact(n):
    """Exact check of the K-SEQ algebra: acceptance mass plus residual mass reproduces p."""
    gen = torch.Generator().manual_seed(n)
    for _ in range(20):
        p = torch.rand(7, generator=gen).pow(3).double()
        q = torch.rand(7, generator=gen).pow(3).double()
        p, q = p / p.sum(), q / q.sum()
        rho = SpecTrSampling.solve_rho(p, q, n)
        beta = float(torch.minimum(q, p / rho).sum())
        accept = 1 - (1 - beta) ** n
        assert 1 <= rho <= n and accept <= rho * beta + 1e-9
        if n > 1 and rho > 1:
            assert accept == pytest.approx(rho * beta, abs=1e-4)  # the smallest feasible rho
        unnormalised = p - torch.minimum(q, p / rho) * accept / beta
        assert float(unnormalised.min()) >= -1e-9
        output = torch.minimum(q, p / rho) * accept / beta + unnormalised
        torch.testing.assert_close(output, p)
