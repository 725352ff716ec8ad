"""A draft's frequency-ranked vocabulary (models/draft_vocab.py, Transformer.restrict_head)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from quickdraft import cli
from quickdraft.models.config import ModelConfig
from quickdraft.models.draft_vocab import default_vocab_size, read_draft_vocab, write_draft_vocab
from quickdraft.models.lm import NativeLM
from quickdraft.models.transformer import Transformer


def small_model(tie: bool) -> Transformer:
    config = ModelConfig(family="llama", model_type="llama", vocab_size=97, hidden_size=32, n_layers=1,
                         n_heads=4, n_kv_heads=4, head_dim=8, intermediate_size=64,
                         max_position_embeddings=64, tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = Transformer(config)
    if tie:
        model.lm_head.weight = model.embed.weight
    return model.eval().requires_grad_(False)


@pytest.mark.parametrize("tie", [True, False])
def test_restricted_head_scores_only_its_tokens(tie):
    full = NativeLM(small_model(tie))
    ids = torch.tensor([5, 0, 96, 40, 41])
    restricted_model = small_model(tie)
    restricted_model.restrict_head(ids)
    restricted = NativeLM(restricted_model)  # decode kernels pack the restricted head too
    tokens = torch.randint(0, 97, (12,))
    a, b = full.extend(tokens), restricted.extend(tokens)
    others = torch.ones(97, dtype=torch.bool)
    others[ids] = False
    assert torch.isneginf(b[:, others]).all()
    torch.testing.assert_close(b[:, ids], a[:, ids], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="distinct token ids"):
        small_model(tie).restrict_head(torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="distinct token ids"):
        small_model(tie).restrict_head(torch.tensor([97]))


def test_vocab_file_round_trip_and_sizes(tmp_path):
    counts = np.array([5, 0, 9, 9, 1, 7])
    record = write_draft_vocab(tmp_path, counts, 3)
    assert record["ranking"] == [2, 3, 5, 0, 4, 1]  # most frequent first, ties by id
    assert record["size_covers"] == pytest.approx(25 / 31)
    assert read_draft_vocab(tmp_path).tolist() == [2, 3, 5]
    assert read_draft_vocab(tmp_path, 4).tolist() == [2, 3, 5, 0]
    assert read_draft_vocab(tmp_path, 0) is None and read_draft_vocab(tmp_path, 6) is None
    with pytest.raises(ValueError, match="between 0 .all. and 6"):
        read_draft_vocab(tmp_path, 7)
    assert read_draft_vocab(tmp_path / "none") is None  # no file: the whole vocabulary
    # An EAGLE drafter's file ranks only the rows it stores.
    (tmp_path / "eagle").mkdir()
    assert write_draft_vocab(tmp_path / "eagle", counts, 3, np.array([0, 1, 3, 5]))["ranking"] == [3, 5, 0, 1]
    assert read_draft_vocab(tmp_path / "eagle", 2).tolist() == [3, 5]
    assert read_draft_vocab(tmp_path / "eagle", 4) is None
    with pytest.raises(ValueError, match="no draft_vocab.json"):
        read_draft_vocab(tmp_path / "none", 10)
    assert default_vocab_size(8192) == 1024 and default_vocab_size(128256) == 16064
    assert default_vocab_size(1000) == 0  # small vocabularies: all of it


def test_embedded_draft_drafts_with_its_vocabulary_and_output_is_unchanged():
    from quickdraft.generator import SpeculativeGenerator
    from quickdraft.models.registry import ASSETS_DIR

    shipped = json.loads((ASSETS_DIR / "qd-stdlib-draft" / "draft_vocab.json").read_text())
    spec = SpeculativeGenerator.from_pretrained()
    assert spec.drafter.model.model.head_ids.tolist() == shipped["ranking"][: shipped["size"]]
    full = SpeculativeGenerator.from_pretrained(draft_vocab=0)
    plain = SpeculativeGenerator.from_pretrained(method="ar")
    prompt = "def read_config(path):\n    "
    a = spec.generate(prompt, max_new_tokens=48, num_speculative_tokens=6)
    b = full.generate(prompt, max_new_tokens=48, num_speculative_tokens=6)
    c = plain.generate(prompt, max_new_tokens=48)
    assert a.token_ids == b.token_ids == c.token_ids
    assert a.stats.accepted_tokens > 0


def test_bad_draft_vocab_is_one_line_exit_2(capsys):
    assert cli.main(["generate", "--prompt", "x", "--draft-vocab", "100000", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--draft-vocab must be between 0 (all) and 8192" in err and "\n" not in err
    with pytest.raises(SystemExit) as exit_info:  # argparse's own check
        cli.main(["generate", "--prompt", "x", "--draft-vocab", "-1"])
    assert exit_info.value.code == 2 and "--draft-vocab: must be >= 0" in capsys.readouterr().err
