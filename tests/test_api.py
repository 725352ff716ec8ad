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


def test_stats_merge_pools_counts_and_positions():
    from quickdraft.stats import GenerationStats

    a, b = GenerationStats(), GenerationStats()
    a.record_step(3, 2)
    a.new_tokens, a.decode_seconds = 3, 0.5
    b.record_step(5, 5)
    b.record_step(1, 0)
    b.new_tokens, b.decode_seconds = 7, 0.25
    assert a.merge(b) is a
    assert (a.new_tokens, a.target_forward_passes, a.drafted_tokens, a.accepted_tokens) == (10, 3, 9, 7)
    assert a.drafted_per_position == [3, 2, 2, 1, 1] and a.accepted_per_position == [2, 2, 1, 1, 1]
    assert a.decode_seconds == 0.75
    empty = GenerationStats().merge(b)
    assert empty.drafted_per_position == b.drafted_per_position
