"""Sampled speculative decoding is distributed exactly as the target (statistical test).

Tiny vocabulary, many seeds: the empirical joint distribution of the first three
generated tokens is compared with the exact target distribution, enumerated over every
sequence, by a chi-square test. Tokens 2 and 3 come out of a speculative step, so they
exercise acceptance, the residual and the bonus token. Two deliberately wrong acceptance
rules run through the same test and must fail it: the test has teeth.
"""

from collections import Counter
from itertools import product

import pytest
import torch
from scipy.stats import chisquare

from quickdraft.decoding.engine import decode
from quickdraft.decoding.sampling import SamplingParams, probabilities, sample
from quickdraft.decoding.stopping import StopConditions
from quickdraft.decoding.verify import SpeculativeSampling, Verdict, residual_distribution
from quickdraft.drafters import DraftModelDrafter, Proposal
from quickdraft.models.config import ModelConfig
from quickdraft.models.lm import NativeLM
from quickdraft.models.transformer import Transformer

VOCAB = 5
PROMPT = torch.tensor([0, 3, 1])
N_SAMPLES = 4000


def tiny_transformer(seed: int, sharpness: float, width: int = 16) -> Transformer:
    """A one-layer model over a 5-token vocabulary, its logits scaled by ``sharpness``."""
    config = ModelConfig(
        family="llama", model_type="llama", vocab_size=VOCAB, hidden_size=width, n_layers=1, n_heads=2,
        n_kv_heads=2, head_dim=width // 2, intermediate_size=2 * width, max_position_embeddings=32,
    )
    torch.manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
        model.lm_head.weight.mul_(sharpness)
    return model


def tiny_lm(seed: int, sharpness: float, head_vocab: list[int] | None = None,
            dtype: torch.dtype = torch.float32) -> NativeLM:
    model = tiny_transformer(seed, sharpness)
    if head_vocab is not None:  # a draft vocabulary: q is zero outside it
        model.restrict_head(torch.tensor(head_vocab))
    return NativeLM(model.to(dtype).eval())


def exact_distribution(lm: NativeLM, params: SamplingParams, n: int = 3) -> dict[tuple, float]:
    """P(first n tokens) by enumerating every continuation in one batched forward."""
    seqs = torch.tensor(list(product(range(VOCAB), repeat=n)))
    ids = torch.cat([PROMPT.expand(len(seqs), -1), seqs], dim=1)
    cache = lm.model.new_cache(len(seqs), ids.shape[1])
    positions = torch.arange(ids.shape[1]).expand(len(seqs), -1)
    with torch.no_grad():
        logits = lm.model(ids, positions, cache).logits
    probs = probabilities(logits, params)
    start = len(PROMPT) - 1
    step_probs = probs[:, start : start + n].gather(2, seqs[:, :, None])[..., 0]
    return {tuple(s.tolist()): float(p) for s, p in zip(seqs, step_probs.prod(dim=1))}


class NoResidual(SpeculativeSampling):
    """WRONG: on rejection, resample from p instead of norm(max(p - q, 0))."""

    def update(self, p, q):
        return p


class AcceptWhenPAtLeastQ(SpeculativeSampling):
    """WRONG: accept x deterministically when p(x) >= q(x) instead of with prob min(1, p/q)."""

    def __call__(self, proposal, target_logits):
        p = probabilities(target_logits, self.params)
        draft_probs = proposal.probs
        for i, x in enumerate(proposal.tokens.tolist()):
            if p[i, x] < draft_probs[i, x]:
                return Verdict(list(range(i)), sample(residual_distribution(p[i], draft_probs[i]), self.generator))
        return Verdict(list(range(proposal.size)), sample(p[-1], self.generator))


class FixedDrafter:
    """A deterministic drafter (like n-gram lookup): q is one-hot, probs is None."""

    name = "fixed"

    def verify_width(self, k):
        return k + 1

    def join(self, slot, prompt, params, generator, max_len):
        pass

    def propose(self, slots, sequences, ks):
        return [Proposal.chain(torch.tensor([2, 4, 1, 0][:k])) for k in ks]

    def verified(self, slot, length, path):
        pass

    def leave(self, slot):
        pass


def empirical_pvalue(target, drafter, params, rule_cls=None, k=2, n_samples=N_SAMPLES):
    counts: Counter = Counter()
    for seed in range(n_samples):
        p = SamplingParams(params.temperature, params.top_k, params.top_p, seed=seed)
        rule = rule_cls(p, p.generator()) if rule_cls else None
        steps = decode(target, PROMPT, StopConditions(3), drafter=drafter, params=p,
                       num_speculative_tokens=k, acceptance=rule)
        counts[tuple(t for s in steps for t in s.tokens)] += 1
    exact = exact_distribution(target, params)
    assert sum(counts[c] for c, prob in exact.items() if prob > 0) == n_samples, "sample outside the support"
    # Chi-square needs expected counts >= 5: pool the rarer sequences into one cell.
    common = [c for c, prob in exact.items() if prob * n_samples >= 5]
    rare = [c for c, prob in exact.items() if 0 < prob * n_samples < 5]
    observed = [counts[c] for c in common]
    expected = [exact[c] * n_samples for c in common]
    if rare:
        observed.append(sum(counts[c] for c in rare))
        expected.append(sum(exact[c] for c in rare) * n_samples)
    scale = n_samples / sum(expected)  # float rounding of the enumerated probabilities
    return chisquare(observed, [e * scale for e in expected]).pvalue


TARGET = tiny_lm(0, 3.0)
DRAFT = DraftModelDrafter(tiny_lm(1, 3.0), VOCAB)  # a different model: many rejections


@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4, top_p=0.9)],
    ids=["t1", "warped"],
)
def test_speculative_sampling_matches_target_distribution(params):
    # The sampling generator of each run is seeded: deterministic, so this cannot flake.
    assert empirical_pvalue(TARGET, DRAFT, params) > 1e-3


@pytest.mark.slow
def test_draft_with_a_restricted_vocabulary_is_exact_too():
    # The draft scores tokens 0, 2 and 3 only: tokens 1 and 4 come from the residual alone.
    drafter = DraftModelDrafter(tiny_lm(1, 3.0, head_vocab=[3, 0, 2]), VOCAB)
    assert empirical_pvalue(TARGET, drafter, SamplingParams(temperature=1.0), k=3) > 1e-3


@pytest.mark.slow
def test_deterministic_drafter_is_exact_too():
    assert empirical_pvalue(TARGET, FixedDrafter(), SamplingParams(temperature=1.0), k=3) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("wrong_rule", [NoResidual, AcceptWhenPAtLeastQ])
def test_wrong_acceptance_rules_fail_the_same_test(wrong_rule):
    assert empirical_pvalue(TARGET, DRAFT, SamplingParams(temperature=1.0), wrong_rule) < 1e-6


def test_residual_guard_when_p_equals_q():
    p = torch.tensor([0.2, 0.3, 0.5])
    torch.testing.assert_close(residual_distribution(p, p.clone()), p)
    torch.testing.assert_close(residual_distribution(p, torch.tensor([0.4, 0.3, 0.3])), torch.tensor([0.0, 0.0, 1.0]))
