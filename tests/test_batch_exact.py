"""A batched row's sampled output is distributed exactly as the target (chi-square).

The statistical test of test_sampling_exact.py, run through the batched engine: eight
rows at a time (each its own seed, next to a row with a longer prompt), first three
tokens of each row against the enumerated target distribution, with the draft model and
with each head method (a chain drafter per row, heads shared; hybrid-eagle's prompt lookup
beside it). A wrong rule fails it.
"""

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare
from test_sampling_exact import PROMPT, NoResidual, exact_distribution, tiny_lm

from quickdraft.batch_generate import make_batch_engine
from quickdraft.decoding.sampling import SamplingParams
from quickdraft.decoding.stopping import StopConditions
from quickdraft.drafters import DraftOptions

TARGET, DRAFT = tiny_lm(0, 3.0), tiny_lm(1, 3.0)
N = 1200  # fewer than test_sampling_exact.py: each batch also runs a neighbour row
ROWS = 8


def head_options(method: str) -> DraftOptions:
    """Random heads for the tiny target, as the single-row tests of each method build them."""
    if method in ("eagle", "hybrid-eagle"):
        from test_eagle import random_head

        heads = random_head(TARGET.model, torch.tensor([0, 1, 3]))
        # hybrid-eagle: two-token tails, so that prompt lookup matches in these short rows
        # (its one-hot proposals beside the drafter's sampled chains, row by row).
        return DraftOptions(heads=heads, ngram_max=2, ngram_min=2) if method == "hybrid-eagle" else DraftOptions(heads=heads)
    if method == "medusa":
        from test_medusa import random_heads

        return DraftOptions(heads=random_heads(2, TARGET.config.hidden_size))
    from test_prophet import random_prophet

    return DraftOptions(heads=random_prophet(TARGET.config.hidden_size, TARGET.vocab_size, n_start=1))


def batched_pvalue(params: SamplingParams, rule=None, n_samples: int = N, method: str = "draft") -> float:
    kwargs = {"acceptance": rule} if rule else {}
    if method != "draft":
        kwargs["options"] = head_options(method)
    engine = make_batch_engine(TARGET, method=method, draft=DRAFT if method == "draft" else None,
                               max_batch_size=ROWS + 1, max_len=16, num_speculative_tokens=2, **kwargs)
    counts: Counter = Counter()
    drafted = 0  # accepted draft tokens: the rows really speculated
    for start in range(0, n_samples, ROWS):
        rows = {}
        for seed in range(start, min(start + ROWS, n_samples)):
            p = SamplingParams(params.temperature, params.top_k, params.top_p, seed=seed)
            rows[engine.add(PROMPT, p, StopConditions(3))] = []
        # A ragged neighbour: longer prompt, other settings, its tokens ignored.
        engine.add(torch.tensor([1, 2, 3, 4, 0, 2, 1]), SamplingParams(0.5, seed=start), StopConditions(5))
        while engine.active:
            for row, update in engine.step().items():
                if row in rows:
                    rows[row].extend(update.tokens)
                    drafted += update.drafted
        counts.update(tuple(t) for t in rows.values())
    assert drafted > n_samples // 10, drafted
    exact = exact_distribution(TARGET, params)
    assert sum(counts[c] for c, prob in exact.items() if prob > 0) == n_samples, "sample outside the support"
    common = [c for c, prob in exact.items() if prob * n_samples >= 5]
    rare = [c for c, prob in exact.items() if 0 < prob * n_samples < 5]
    observed = [counts[c] for c in common] + ([sum(counts[c] for c in rare)] if rare else [])
    expected = [exact[c] * n_samples for c in common] + ([sum(exact[c] for c in rare) * n_samples] if rare else [])
    scale = n_samples / sum(expected)
    return chisquare(observed, [e * scale for e in expected]).pvalue


@pytest.mark.slow
def test_batched_sampling_matches_target_distribution():
    assert batched_pvalue(SamplingParams(temperature=1.0)) > 1e-3


@pytest.mark.slow
def test_wrong_rule_fails_the_batched_test():
    assert batched_pvalue(SamplingParams(temperature=1.0), NoResidual, n_samples=800) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle", "medusa", "prophet", "hybrid-eagle"])
def test_batched_head_rows_sample_the_target_distribution(method):
    assert batched_pvalue(SamplingParams(temperature=1.0), method=method) > 1e-3


@pytest.mark.slow
def test_wrong_rule_fails_the_batched_head_test():
    assert batched_pvalue(SamplingParams(temperature=1.0), NoResidual, n_samples=800, method="eagle") < 1e-6
