"""One loader for a target, its tokenizer and a draft: the generator's and the bench's."""

from __future__ import annotations

import shutil

import pytest

from quickdraft import pair as pair_module
from quickdraft.generator import SpeculativeGenerator
from quickdraft.pair import load_pair


def test_load_pair(tiny_family):
    pair = load_pair(str(tiny_family["target"]), str(tiny_family["perturbed"]))
    assert pair.target.backend == "native" and pair.draft is not None
    assert pair.target_dir == tiny_family["target"] and pair.draft_dir == tiny_family["perturbed"]
    assert pair.tokenizer.eos_token_id is not None
    alone = load_pair(str(tiny_family["target"]), need_draft=False, backend="hf")
    assert alone.draft is None and alone.draft_dir is None and alone.target.backend == "hf"


def test_load_pair_refuses_another_tokenizer(tiny_family, tmp_path):
    from conftest import build_tokenizer

    other = tmp_path / "other"
    shutil.copytree(tiny_family["unrelated"], other)
    build_tokenizer(other, vocab_size=280)
    with pytest.raises(ValueError, match="different tokenizers"):
        load_pair(str(tiny_family["target"]), str(other))


def test_generator_and_bench_share_load_pair(tiny_family, monkeypatch):
    from quickdraft.bench.config import BenchConfig
    from quickdraft.bench.context import load_context

    calls = []
    real = pair_module.load_pair

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(pair_module, "load_pair", spy)
    SpeculativeGenerator.from_pretrained(str(tiny_family["target"]), str(tiny_family["perturbed"]))
    load_context(BenchConfig(model=str(tiny_family["target"]), draft=str(tiny_family["perturbed"])))
    assert len(calls) == 2
