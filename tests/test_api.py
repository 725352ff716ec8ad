"""The Python API: explicit keyword parameters, the stream handle, shared helpers."""

from __future__ import annotations

from types import SimpleNamespace

from quickdraft.models.lm import eos_token_ids


def test_eos_token_ids_merges_target_and_tokenizer_once():
    target = SimpleNamespace(eos_token_ids=[2, 0, 2])
    assert eos_token_ids(target, SimpleNamespace(eos_token_id=0)) == [2, 0]
    assert eos_token_ids(target, SimpleNamespace(eos_token_id=7)) == [2, 0, 7]
    assert eos_token_ids(target, SimpleNamespace(eos_token_id=None)) == [2, 0]
    assert eos_token_ids(target, None) == [2, 0]
    assert eos_token_ids(SimpleNamespace(eos_token_ids=[]), SimpleNamespace(eos_token_id=3)) == [3]
