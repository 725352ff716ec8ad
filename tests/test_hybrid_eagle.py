"""``--method hybrid-eagle``: the n-gram's continuation where one matches, else an EAGLE
drafter's chain, which feeds the tokens it skipped (with the target's features) when it
next drafts. Lossless (greedy equality, sampled output distributed as the target's where a
wrong rule fails the same test), both drafters really propose, the drafter's chain after
a catch-up is the one a drafter fed everything at once drafts, and bad input is one line."""

from __future__ import annotations

import json

import pytest
import torch
from test_eagle import TARGET, random_head
from test_sampling_exact import empirical_pvalue
from test_trees_exact import MSSWithoutResidualUpdate

from quickdraft.cli import main
from quickdraft.decoding.sampling import SamplingParams
from quickdraft.drafters import DraftOptions, make_drafter
from quickdraft.drafters.eagle import EagleDrafter
from quickdraft.drafters.hybrid import HybridDrafter
from quickdraft.drafters.ngram import NgramDrafter
from quickdraft.drafters.shapes import StaticTree
from quickdraft.generator import SpeculativeGenerator

# Code that repeats itself (the n-gram's rounds) and code that does not (the drafter's).
PROMPTS = ["def median(values):\n", "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self"]


def sampled_hybrid(shape: StaticTree, ngram_min: int) -> HybridDrafter:
    return HybridDrafter(NgramDrafter(3, ngram_min),
                         EagleDrafter(TARGET, random_head(TARGET.model, torch.tensor([0, 1, 3])), shape))


@pytest.mark.slow
@pytest.mark.parametrize("shape", [StaticTree((1, 1)), StaticTree((1, 1), sample=False)], ids=["sampled", "top"])
def test_sampled_hybrid_eagle_matches_the_target_distribution(shape):
    # ngram_min 1: on the 5-token vocabulary a one-token tail matches often, so both drafters propose
    drafter = sampled_hybrid(shape, ngram_min=1)
    rounds = record_rounds(drafter)
    assert empirical_pvalue(TARGET, drafter, SamplingParams(temperature=1.0), n_samples=2000) > 1e-3
    assert {(r["who"], r["size"] > 0) for r in rounds} >= {("ngram", True), ("eagle", True)}


@pytest.mark.slow
def test_a_wrong_rule_fails_the_same_hybrid_eagle_test():
    """The drafter's sampled chains are where the rule's residual matters: with ngram_min 2
    (no n-gram match in 3 tokens) they are every round. (Mixed with the n-gram's one-hot
    rounds, which this sharp tiny target mostly accepts, the wrong rule read p = 0.02 over
    2,000 samples: too diluted for a test.)"""
    assert empirical_pvalue(TARGET, sampled_hybrid(StaticTree((1, 1)), ngram_min=2), SamplingParams(temperature=1.0),
                            MSSWithoutResidualUpdate, n_samples=500) < 1e-6


def record_rounds(drafter: HybridDrafter) -> list[dict]:
    """Per round that drafted: ``who`` proposed ("ngram", "eagle"; "none": nothing), the
    tokens the EAGLE drafter fed before its chain (``backlog``), whether it drafted
    without the target's states (``blind``), the ``sequence`` and ``k`` it drafted after,
    and the ``size`` of the proposal."""
    rounds: list[dict] = []
    eagle = drafter.model
    propose, eagle_propose = drafter.propose, eagle.propose

    def by_hybrid(slots, sequences, ks):
        rounds.append({"who": "none"})
        out = propose(slots, sequences, ks)
        rounds[-1]["size"] = out[0].size
        if out[0].size and rounds[-1]["who"] == "none":
            rounds[-1]["who"] = "ngram"
        return out

    def by_eagle(slots, sequences, ks):  # asked when the n-gram found nothing
        n = sequences[0].shape[0]
        rounds[-1].update(who="eagle", backlog=n - eagle.fed, blind=eagle.known < n - 1,
                          sequence=sequences[0].clone(), k=ks[0])
        out = eagle_propose(slots, sequences, ks)
        rounds[-1]["tokens"] = out[0].tokens.tolist()
        return out

    drafter.propose, eagle.propose = by_hybrid, by_eagle
    drafter.greedy_rounds = None  # every round through propose (several in one C call: test_spec_rounds.py)
    return rounds


def chain_of_a_drafter_fed_everything(gen: SpeculativeGenerator, sequence: torch.Tensor, k: int) -> list[int]:
    """The chain a fresh EAGLE drafter (same drafter, same chain) proposes after
    ``sequence`` when it was fed every token but the last at once, with the target's states
    from one pass over them (our kernels round each row alike whatever the rows beside it)."""
    fresh = make_drafter("eagle", None, gen.target.vocab_size, DraftOptions(tree="1,1", heads=gen.drafter.model.head),
                         target=gen.target)
    seen = sequence[:-1]
    gen.target.reset(sequence.numel() + 8)
    gen.target.extend(seen, logits=1, output_hidden_states=fresh.reads_hidden)
    fresh.join(0, seen, SamplingParams(), torch.Generator(), sequence.numel() + 8)
    fresh.observe(0, 0, gen.target.hidden_states)
    return fresh.propose([0], [sequence], [k])[0].tokens.tolist()


def test_greedy_hybrid_eagle_equals_plain_and_its_drafter_catches_up():
    """On the embedded target with its shipped drafter: output is plain decoding's; both
    the n-gram and the drafter propose; after n-gram rounds the drafter first feeds the
    tokens it skipped, and then drafts the chain a fresh drafter fed every token at once
    drafts (stale, shifted or missing features would not)."""
    plain = SpeculativeGenerator.from_pretrained(method="ar")
    hybrid = SpeculativeGenerator.from_pretrained(method="hybrid-eagle")
    assert isinstance(hybrid.drafter, HybridDrafter) and hybrid.drafter.reads_hidden == hybrid.drafter.model.reads_hidden
    assert hybrid.resolve_k() == (6, "default") and hybrid.drafter.model.shape.depth(6) == 2  # n-gram 6, chain 2
    rounds = record_rounds(hybrid.drafter)
    for prompt in PROMPTS:
        rounds.clear()
        got = hybrid.generate(prompt, max_new_tokens=64)
        assert got.token_ids == plain.generate(prompt, max_new_tokens=64).token_ids
        assert {r["who"] for r in rounds} >= {"ngram", "eagle"}, rounds
        assert any(r["who"] == "eagle" and r["backlog"] > 2 for r in rounds), rounds  # a catch-up happened
        assert not any(r.get("blind") for r in rounds[1:]), rounds  # only the first, before the prefill
        assert all(r["size"] <= 2 for r in rounds if r["who"] == "eagle")
        caught_up = [r for r in rounds if r["who"] == "eagle" and r["backlog"] > 1 and not r["blind"]]
        assert caught_up
        for r in caught_up:  # the chain after a catch-up is the one of a drafter fed everything at once
            assert r["tokens"] == chain_of_a_drafter_fed_everything(hybrid, r["sequence"], r["k"]), r


def test_hybrid_eagle_in_the_cli_and_its_one_line_errors(tiny_family, capsys):
    common = ["generate", "--max-new-tokens", "24", "--json", "--prompt", "def add(a, b):\n    return a + b\n\n\ndef"]
    assert main([*common, "--method", "ar"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*common, "--method", "hybrid-eagle", "--tree", "1,1,1"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["token_ids"] == plain["token_ids"] and got["settings"]["method"] == "hybrid-eagle"
    assert main([*common, "--method", "hybrid-eagle", "--tree", "2,1"]) != 0
    assert "drafts a chain" in capsys.readouterr().err
    tiny = ["generate", "--model", str(tiny_family["target"]), "--prompt", "x", "--max-new-tokens", "4"]
    assert main([*tiny, "--method", "hybrid-eagle"]) != 0  # nothing shipped for it
    err = capsys.readouterr().err
    assert "hybrid-eagle) needs an EAGLE drafter" in err and "Traceback" not in err
    assert main([*tiny, "--method", "hybrid-eagle", "--backend", "hf"]) != 0
    assert "native runtime" in capsys.readouterr().err


def test_hybrid_eagle_refuses_a_tree_in_the_api():
    with pytest.raises(ValueError, match="drafts a chain"):
        make_drafter("hybrid-eagle", None, TARGET.vocab_size, DraftOptions(tree="dynamic:4"), target=TARGET)
