"""Bench settings: one source of defaults (full and --quick) and of their checks."""

from __future__ import annotations

import argparse

import pytest

from quickdraft.bench.cli import add_bench_parser
from quickdraft.bench.config import DEFAULT_METHODS, FULL, QUICK, BenchConfig, BenchError


def test_defaults_come_from_the_presets():
    full = BenchConfig()
    assert (full.max_new_tokens, full.repeats, tuple(full.sweep)) == (FULL.max_new_tokens, FULL.repeats, FULL.sweep)
    assert tuple(full.methods) == DEFAULT_METHODS and full.backend == "auto"
    quick = BenchConfig.create(quick=True)
    assert (quick.max_new_tokens, quick.repeats, tuple(quick.sweep)) == (
        QUICK.max_new_tokens, QUICK.repeats, QUICK.sweep)
    given = BenchConfig.create(quick=True, max_new_tokens=7, repeats=None, sweep=(2, 3))
    assert given.max_new_tokens == 7 and given.repeats == QUICK.repeats and tuple(given.sweep) == (2, 3)
    assert BenchConfig.create(methods=("ar", "hf-ar")).sweep == ()  # no draft rows, no sweep


def test_help_shows_the_preset_values():
    parser = argparse.ArgumentParser(prog="quickdraft")
    sub = parser.add_subparsers()
    text = " ".join(add_bench_parser(sub).format_help().split())
    assert f"default {FULL.max_new_tokens}; quick {QUICK.max_new_tokens}" in text
    assert f"default {FULL.repeats}; quick {QUICK.repeats}" in text


@pytest.mark.parametrize("given, message", [
    (dict(repeats=0), "--repeats"), (dict(max_new_tokens=0), "--max-new-tokens"),
    (dict(temperature=-1.0), "--temperature"), (dict(k=0), "-k"), (dict(sweep=(0,)), "--sweep"),
    (dict(threads=0), "--threads"), (dict(methods=("ar", "nope")), "unknown method"),
    (dict(methods=()), "no methods"), (dict(backend="gpu"), "unknown backend"),
])
def test_checks(given, message):
    with pytest.raises(BenchError, match=message):
        BenchConfig.create(**given)
    with pytest.raises(BenchError, match=message):  # the API runs the same checks
        BenchConfig(**given).validate()


def test_the_bench_runs_every_method_of_the_method_table():
    """The bench reads the one method table: every decoding method is a bench method, and
    loads the draft exactly when the table says the method needs one."""
    from quickdraft.bench.config import BENCH_METHODS
    from quickdraft.drafters.factory import METHODS, NEEDS_DRAFT

    assert set(METHODS) <= set(BENCH_METHODS)
    assert {m for m in METHODS if BENCH_METHODS[m].needs_draft} == set(NEEDS_DRAFT)
