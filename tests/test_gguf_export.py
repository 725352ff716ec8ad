"""GGUF export (for llama.cpp): the embedded pair written as GGUF loads back through our
own GGUF loader with the source model's logits and tokenizer; a draft's restricted head
becomes a full-vocabulary head whose greedy choice is the restricted one's."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny

from quickdraft.models.draft_vocab import read_draft_vocab
from quickdraft.models.errors import CheckpointError
from quickdraft.models.gguf_export import cached_export, export_gguf, full_vocab_head
from quickdraft.models.lm import NativeLM, load_model
from quickdraft.models.loading import load_native
from quickdraft.models.registry import ASSETS_DIR
from quickdraft.pair import load_tokenizer

TARGET, DRAFT = ASSETS_DIR / "qd-stdlib-target", ASSETS_DIR / "qd-stdlib-draft"
TEXT = "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(description='x')\n"


def logits_of(lm, ids: torch.Tensor) -> torch.Tensor:
    lm.reset(64)
    return lm.extend(ids)


@pytest.fixture(scope="module")
def ids():
    return torch.tensor(load_tokenizer(TARGET)(TEXT)["input_ids"])


def test_target_round_trip_keeps_logits_and_tokenizer(tmp_path, ids):
    path = export_gguf(TARGET, tmp_path / "target.gguf")
    torch.testing.assert_close(logits_of(load_model(path), ids), logits_of(load_model(TARGET), ids),
                               atol=1e-4, rtol=1e-4)
    # transformers builds the tokenizer from the GGUF metadata: the same ids, the same text
    exported = load_tokenizer(path)
    assert exported(TEXT)["input_ids"] == ids.tolist()
    assert exported.decode(ids.tolist()) == TEXT


def test_draft_head_outside_its_vocabulary_never_wins(tmp_path, ids):
    head_ids = read_draft_vocab(DRAFT)
    assert head_ids is not None and head_ids.numel() < 8192
    path = export_gguf(DRAFT, tmp_path / "draft.gguf", head_ids=head_ids)
    model = load_native(DRAFT)
    model.restrict_head(head_ids)  # before NativeLM packs the head, as loading a draft does
    restricted = NativeLM(model, DRAFT)
    full = logits_of(load_model(path), ids)
    expected = logits_of(restricted, ids)
    assert torch.equal(full.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(full[:, head_ids], expected[:, head_ids], atol=1e-4, rtol=1e-4)
    others = torch.ones(full.shape[-1], dtype=torch.bool)
    others[head_ids] = False
    assert (full[:, others].max(-1).values < full[:, head_ids].max(-1).values).all()


def test_mean_rows_stay_below_the_best_even_when_all_logits_are_negative():
    head = -torch.rand(10, 4) - 1  # every row negative: a zero row would win on x = ones
    ids = torch.tensor([2, 5, 7])
    full = full_vocab_head(head, ids)
    x = torch.ones(4)
    assert int((full @ x).argmax()) in ids.tolist()
    assert torch.equal(full[ids], head[ids])


def test_cached_export_is_reused_and_keyed_by_content(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = cached_export(TARGET)
    mtime = first.stat().st_mtime_ns
    assert cached_export(TARGET) == first and first.stat().st_mtime_ns == mtime
    assert cached_export(DRAFT, head_ids=torch.arange(10)) != cached_export(DRAFT)


@pytest.mark.parametrize("arch", ["gpt2", "qwen2", "llama3-rope"])
def test_what_llama_cpp_would_run_differently_is_refused(tmp_path, arch):
    save_tiny(arch, tmp_path / arch)
    with pytest.raises(CheckpointError, match="export to GGUF"):
        export_gguf(tmp_path / arch, tmp_path / "x.gguf")
