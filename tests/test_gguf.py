"""GGUF checkpoints: tiny files written here load natively with the same logits and greedy
tokens as transformers' own GGUF loading, for every tensor type we support; bad files and
unsupported types or architectures are one-line errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_files import HEADS, HIDDEN, write_tiny_gguf

from quickdraft.cli import main
from quickdraft.models import gguf
from quickdraft.models.lm import HFCausalLM, NativeLM, load_model
from quickdraft.models.loading import CheckpointError, resolve_model_dir
from quickdraft.models.placement import resolve_placement
from quickdraft.pair import load_pair

pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")

PROMPT = torch.tensor([5, 17, 200, 3, 99, 42, 7, 260, 1, 64])
# Types gguf quantizes in numpy, and the K-quants (random blocks), each against transformers.
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def greedy(lm, prompt: torch.Tensor, steps: int) -> list[int]:
    """Plain greedy decoding through the engine-facing model handle."""
    lm.reset(64)
    logits = lm.extend(prompt, "last")
    out = []
    for _ in range(steps):
        token = int(logits[-1].argmax())
        out.append(token)
        logits = lm.extend(torch.tensor([token]), "last")
    return out


@pytest.mark.parametrize("qtype", TYPES)
def test_native_gguf_matches_transformers(tmp_path, qtype):
    assert set(TYPES) == set(gguf.SUPPORTED_TYPES)
    path = tmp_path / f"tiny-{qtype}.gguf"
    write_tiny_gguf(path, qtype, tied=qtype in ("F16", "Q4_K"))
    # Q8_0, Q4_0 and Q4_1 run on our int8 / int4 kernels by default, which quantize
    # activations to 8 bits as llama.cpp does (checked against their own references in
    # test_quant_linear): the exact parity with transformers is that of the file's weights,
    # dequantized.
    placement = resolve_placement(quantize="none") if qtype in ("Q8_0", "Q4_0", "Q4_1") else None
    ours = load_model(path, placement=placement)
    theirs = HFCausalLM(gguf.load_hf_model(path, torch.float32), path)
    assert isinstance(ours, NativeLM)
    ours.reset(64)
    theirs.reset(64)
    a, b = ours.extend(PROMPT), theirs.extend(PROMPT)
    # Float32 rounding only: our AVX2 products sum in 16 partial sums, MKL in its own order
    # (Q6_K's logits differed by up to 1.5e-4); a wrongly dequantized block is off by far more.
    torch.testing.assert_close(a, b, atol=3e-4, rtol=1e-4)
    assert greedy(ours, PROMPT, 8) == greedy(theirs, PROMPT, 8)


def test_native_gguf_matches_the_original_weights(tmp_path):
    """Against a Llama built from the weights before they were written (q/k in Hugging Face
    order): the row permutation is undone, whatever transformers does."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path / "tiny.gguf"
    weights = write_tiny_gguf(path, "F32")
    cfg = LlamaConfig(vocab_size=weights["model.embed_tokens.weight"].shape[0], hidden_size=HIDDEN,
                      intermediate_size=512, num_hidden_layers=2, num_attention_heads=HEADS,
                      num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=128,
                      tie_word_embeddings=False)
    reference = LlamaForCausalLM(cfg).eval()
    reference.load_state_dict(weights, strict=True)
    ours = load_model(path)
    ours.reset(64)
    with torch.no_grad():
        expected = reference(PROMPT[None]).logits[0]
    torch.testing.assert_close(ours.extend(PROMPT), expected, atol=1e-4, rtol=1e-4)


def test_gguf_pair_uses_the_files_tokenizer_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "Q8_0")
    pair = load_pair(str(path), need_draft=False)
    assert pair.target_dir == path and isinstance(pair.target, NativeLM)
    assert pair.tokenizer.decode(pair.tokenizer("the cat in the hat").input_ids) == "the cat in the hat"
    assert pair.target.eos_token_ids == [0]
    # The second load reads the tokenizer saved in the (test-private) cache: the same one.
    cached = gguf.load_tokenizer(path)
    assert cached.get_vocab() == pair.tokenizer.get_vocab()
    text = "the cat in the hat<|endoftext|> in"
    assert cached(text).input_ids == pair.tokenizer(text).input_ids
    assert any(gguf.tokenizer_cache_dir().iterdir())


def test_generate_cli_runs_a_gguf_file(tmp_path, capsys):
    import json

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "Q4_0")
    common = ["generate", "--model", str(path), "--prompt", "the cat in", "--max-new-tokens", "12", "--json"]
    assert main([*common, "--method", "ar"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*common, "--method", "ngram"]) == 0
    ngram = json.loads(capsys.readouterr().out)
    assert ngram["token_ids"] == plain["token_ids"] and len(plain["token_ids"]) > 0


def test_unsupported_quantization_is_one_line(tmp_path, capsys):
    from gguf import GGMLQuantizationType

    path = tmp_path / "iq.gguf"
    write_tiny_gguf(path, "Q8_0")
    # Relabel one tensor's type in the header: the check must refuse before reading data.
    data = bytearray(path.read_bytes())
    reader = gguf.open_gguf(path)
    tensor = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    type_offset = tensor.field.offset + len(tensor.field.parts[0].tobytes()) + len(
        tensor.field.parts[1].tobytes()) + 4 + 8 * len(tensor.shape)
    assert int.from_bytes(data[type_offset:type_offset + 4], "little") == GGMLQuantizationType.Q8_0
    data[type_offset:type_offset + 4] = int(GGMLQuantizationType.IQ2_XXS).to_bytes(4, "little")
    bad = tmp_path / "iq2.gguf"
    bad.write_bytes(bytes(data))
    assert main(["generate", "--model", str(bad), "--prompt", "x", "--method", "ar"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "IQ2_XXS" in err and "Q4_K" in err and "blk.0.attn_q.weight" in err


def test_other_architectures_fall_back_or_fail_in_one_line(tmp_path, capsys):
    path = tmp_path / "falcon.gguf"
    write_tiny_gguf(path, "F32", arch="falcon")
    with pytest.raises(Exception, match="not supported by the native runtime"):
        load_model(path, "native")
    # A native-only method says so before loading anything.
    assert main(["generate", "--model", str(path), "--prompt", "x", "--method", "tree"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "falcon" in err
    # auto falls back to transformers, which maps falcon tensors its own way: here they do
    # not fit (llama names), and that is one line too.
    assert main(["generate", "--model", str(path), "--prompt", "x", "--method", "ar"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("quickdraft: error: transformers could not load")


def test_bad_gguf_files_are_one_line_errors(tmp_path, capsys):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    assert main(["generate", "--model", str(junk), "--prompt", "x", "--method", "ar"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "not a readable GGUF file" in err
    with pytest.raises(CheckpointError, match=r"\.gguf file"):
        resolve_model_dir(str(tmp_path / "missing.gguf"))


def test_unpermute_inverts_llamacpp_row_order():
    from gguf_files import llamacpp_rows

    weight = np.arange(8 * 3 * 5, dtype=np.float32).reshape(24, 5)
    back = gguf.unpermute_rope_rows(torch.from_numpy(llamacpp_rows(weight, 3)), 3)
    assert torch.equal(back, torch.from_numpy(weight))


def test_converted_weights_and_header_are_cached(tmp_path, monkeypatch):
    """The first load keeps the header's findings and the converted weights in the cache;
    the next load reads them without opening the file, and a rewritten file is converted
    again (the key has its size and mtime)."""
    import os

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "Q4_1")
    config = gguf.native_config(path)
    first = gguf.load_state_dict(path, config)
    entry = gguf.cache_entry(path)
    assert (entry / gguf.WEIGHTS_FILE).is_file() and (entry / gguf.HEADER_FILE).is_file()
    gguf._open_gguf.cache_clear()
    gguf._header.cache_clear()

    def refuse(*args):
        raise AssertionError("the GGUF file was opened although the cache holds it")

    monkeypatch.setattr(gguf, "_open_gguf", refuse)
    assert gguf.native_config(path) == config
    again = gguf.load_state_dict(path, config)
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)
    monkeypatch.undo()
    # A damaged entry is converted again.
    (entry / gguf.WEIGHTS_FILE).write_bytes(b"not safetensors")
    assert all(torch.equal(v, first[k]) for k, v in gguf.load_state_dict(path, config).items())
    # A rewritten file gets its own entry.
    write_tiny_gguf(path, "Q8_0")
    os.utime(path, ns=(1, 1))
    assert gguf.cache_entry(path) != entry
    changed = gguf.load_state_dict(path, gguf.native_config(path))
    fresh = gguf.convert_state_dict(path, config)
    assert all(torch.equal(changed[k], v) for k, v in fresh.items())
    assert not torch.equal(changed["lm_head.weight"], first["lm_head.weight"])
