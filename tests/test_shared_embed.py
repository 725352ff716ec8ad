"""A draft trained ``--from-target`` shares its target's embeddings: frozen while it trains,
left out of its safetensors, filled from the loaded target (same storage), and refused with
one line next to a target whose embeddings differ (issue #24 point 4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build_tokenizer
from safetensors.torch import load_file

from quickdraft import cli

CODE = '''def total(values):
    """Sum of the values."""
    result = 0
    for v in values:
        result += v
    return result
'''


@pytest.fixture(autouse=True)
def user_config(tmp_path, monkeypatch):
    monkeypatch.setenv("QUICKDRAFT_CONFIG_DIR", str(tmp_path / "config"))


def save_tied_llama(path: Path, tok, seed: int) -> None:
    """A tiny Llama whose LM head is its embedding matrix, as SmolLM2's is."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(20.0)  # sharper distributions: varied tokens
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tied tiny target, another with different weights, and a draft trained from the first."""
    root = tmp_path_factory.mktemp("shared")
    tok = build_tokenizer(root / "tok")
    save_tied_llama(root / "target", tok, seed=0)
    save_tied_llama(root / "other", tok, seed=1)
    (root / "data").mkdir()
    for i in range(8):
        (root / "data" / f"m{i}.py").write_text(CODE.replace("total", f"total{i}") * 3)
    arch = json.dumps({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "intermediate_size": 128, "num_key_value_heads": 2})
    out = root / "draft"
    code = cli.main(["train", "draft", "--target", str(root / "target"), "--out", str(out),
                     "--data", str(root / "data"), "--from-target", "--config", arch,
                     "--kl-weight", "0", "--steps", "4", "--seq-len", "32", "--batch-size", "2",
                     "--lr", "1e-2", "--ckpt-every", "4", "--eval-tokens", "128", "--threads", "1",
                     "--work-dir", str(root / "work"), "--no-progress"])
    assert code == 0
    return root


def test_saved_draft_omits_the_embeddings_and_records_the_target(trained):
    from quickdraft.models.shared_embed import SHARED_KEY, fingerprint

    shipped = load_file(str(trained / "draft" / "model.safetensors"))
    assert not any("embed" in k or "lm_head" in k for k in shipped)
    assert any(".layers.1." in k for k in shipped)  # the layers it trained are there
    target = load_file(str(trained / "target" / "model.safetensors"))["model.embed_tokens.weight"]
    spec = json.loads((trained / "draft" / "quickdraft.json").read_text())[SHARED_KEY]
    assert spec["from"] == "target" and spec["shape"] == list(target.shape)
    assert spec["sha256"] == fingerprint(target)


def test_training_kept_the_embeddings_frozen_and_loading_reproduces_the_draft(trained):
    from quickdraft.generator import SpeculativeGenerator
    from quickdraft.pair import load_pair

    ckpt = sorted((trained / "work").rglob("step-*/model.safetensors"))[-1]
    last = load_file(str(ckpt))  # the trained draft, fp32, embeddings included
    target_embed = load_file(str(trained / "target" / "model.safetensors"))["model.embed_tokens.weight"]
    # (tied: the checkpoint holds the matrix once, under either name)
    embed = last.get("model.embed_tokens.weight", last.get("lm_head.weight"))
    assert torch.equal(embed, target_embed)  # exactly the target's, after training
    shipped = load_file(str(trained / "draft" / "model.safetensors"))

    pair = load_pair(str(trained / "target"), str(trained / "draft"), True, "native", draft_vocab=0)
    draft, target = pair.draft.model, pair.target.model
    assert draft.embed.weight.data_ptr() == target.embed.weight.data_ptr()  # shared, not copied
    # every trained weight loads as saved (bf16 of the trained values)
    q = shipped["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(q.float(), last["model.layers.1.self_attn.q_proj.weight"].bfloat16().float())

    # the transformers backend fills them too, and both runtimes agree on the draft's logits
    hf = load_pair(str(trained / "target"), str(trained / "draft"), True, "hf").draft.model
    ids = torch.tensor([[5, 17, 42, 8, 99, 3]])
    pair.draft.reset()
    with torch.no_grad():
        assert torch.allclose(hf(input_ids=ids).logits[0], pair.draft.extend(ids[0]), atol=1e-4)

    spec = SpeculativeGenerator.from_pretrained(str(trained / "target"), draft=str(trained / "draft"),
                                                method="draft")
    plain = SpeculativeGenerator.from_pretrained(str(trained / "target"), method="ar")
    ours = spec.generate("def total", max_new_tokens=24, temperature=0.0, num_speculative_tokens=3)
    assert ours.token_ids == plain.generate("def total", max_new_tokens=24, temperature=0.0).token_ids


def test_a_mismatched_target_or_none_is_refused_in_one_line(trained, capsys):
    from quickdraft.models.errors import CheckpointError
    from quickdraft.models.lm import load_model
    from quickdraft.pair import load_pair

    with pytest.raises(CheckpointError, match="shares the embeddings") as info:
        load_pair(str(trained / "other"), str(trained / "draft"), True, "native")
    assert "\n" not in str(info.value)
    with pytest.raises(CheckpointError, match="load it with its target"):
        load_model(str(trained / "draft"), "native")
    assert cli.main(["generate", "--model", str(trained / "other"), "--draft", str(trained / "draft"),
                     "--method", "draft", "--max-new-tokens", "4", "--prompt", "def"]) != 0
    err = capsys.readouterr().err.strip()
    assert "shares the embeddings" in err and "Traceback" not in err and "\n" not in err


def test_the_pair_loads_in_bfloat16_and_stays_lossless(trained):
    """``--dtype bfloat16`` rounds the target's embedding: the draft's record knows that
    rounding too, so the pair loads (sharing the rounded tensor) and another target is still
    refused."""
    from quickdraft.generator import SpeculativeGenerator
    from quickdraft.models.errors import CheckpointError
    from quickdraft.models.placement import resolve_placement
    from quickdraft.pair import load_pair

    spec = SpeculativeGenerator.from_pretrained(str(trained / "target"), draft=str(trained / "draft"),
                                                method="draft", dtype="bfloat16")
    assert spec.draft.model.embed.weight.data_ptr() == spec.target.model.embed.weight.data_ptr()
    plain = SpeculativeGenerator.from_pretrained(str(trained / "target"), method="ar", dtype="bfloat16")
    ours = spec.generate("def total", max_new_tokens=24, num_speculative_tokens=3)
    assert ours.token_ids == plain.generate("def total", max_new_tokens=24).token_ids
    with pytest.raises(CheckpointError, match="shares the embeddings"):
        load_pair(str(trained / "other"), str(trained / "draft"), True, "native",
                  placement=resolve_placement("cpu", "bfloat16"))
