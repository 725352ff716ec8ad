"""Greedy output of every method, at batch 1 and batched, equals what the code produced
before the runtime core was reorganised (``tests/golden/greedy_outputs.json``, recorded at
7d6125c on the embedded models), and equals plain decoding.

A refactor that changes what any method generates, at any step, fails here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quickdraft.drafters.factory import BATCH_METHODS, METHODS
from quickdraft.generator import SpeculativeGenerator

GOLDEN = json.loads((Path(__file__).parent / "golden" / "greedy_outputs.json").read_text())


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # auto measures afresh, not from a stale cache


def test_golden_covers_every_method():
    assert set(GOLDEN["outputs"]) == set(METHODS)
    plain = GOLDEN["outputs"]["ar"]
    assert all(out == plain for out in GOLDEN["outputs"].values())  # lossless when recorded


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_output_is_unchanged(method):
    gen = SpeculativeGenerator.from_pretrained(method=method)
    got = [gen.generate(p, max_new_tokens=GOLDEN["max_new_tokens"]).token_ids for p in GOLDEN["prompts"]]
    assert got == GOLDEN["outputs"][method]


@pytest.mark.slow
@pytest.mark.parametrize("method", [m for m in BATCH_METHODS if m != "ar"])
def test_batched_greedy_output_is_unchanged(method):
    gen = SpeculativeGenerator.from_pretrained(method=method)
    outs = gen.generate(GOLDEN["prompts"], max_new_tokens=GOLDEN["max_new_tokens"], batch_size=len(GOLDEN["prompts"]),
                        num_speculative_tokens=3)
    assert [o.token_ids for o in outs] == GOLDEN["outputs"][method]
