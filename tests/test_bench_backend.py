"""``quickdraft bench`` runs every model ``generate`` runs: same --backend, same fallback to
transformers; and it warns when a speculative method is slower than plain decoding."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from quickdraft.bench.cli import add_bench_parser
from quickdraft.bench.prompts import BenchPrompt, save_prompts
from quickdraft.bench.results import slower_than_plain, unmeasured_prompts


def parse(argv):
    parser = argparse.ArgumentParser(prog="quickdraft")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def save_neox(path, tokenizer, seed):
    """A tiny GPT-NeoX checkpoint (an architecture the native runtime does not have)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(seed)
    eos = tokenizer.eos_token_id
    config = GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=64, max_position_embeddings=256,
                           eos_token_id=eos, bos_token_id=eos)
    GPTNeoXForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


@pytest.fixture(scope="module")
def neox_pair(tmp_path_factory):
    from conftest import build_tokenizer

    root = tmp_path_factory.mktemp("neox")
    tok = build_tokenizer(root / "tok")
    save_neox(root / "target", tok, 0)
    save_neox(root / "draft", tok, 1)
    prompts = root / "prompts.jsonl"
    save_prompts([BenchPrompt("a", "def add(a, b):\n", "function-body")], prompts)
    return root


def test_neox_falls_back_to_transformers(neox_pair, tmp_path, capsys):
    from quickdraft.models.config import UnsupportedModelError
    from quickdraft.models.lm import load_model

    with pytest.raises(UnsupportedModelError):  # what makes this a fallback test
        load_model(neox_pair / "target", "native")
    out_json = tmp_path / "neox.json"
    args = parse(["--model", str(neox_pair / "target"), "--draft", str(neox_pair / "draft"),
                  "--prompts", str(neox_pair / "prompts.jsonl"), "--methods", "ar,draft,hf-ar",
                  "--max-new-tokens", "6", "--repeats", "1", "-k", "2", "--sweep", "none",
                  "--json", str(out_json), "--quiet"])
    assert args.func(args) == 0
    captured = capsys.readouterr()
    assert "transformers runtime" in captured.out
    result = json.loads(out_json.read_text())
    for line in result["warnings"]:  # slower methods are named on stderr, one line each
        assert f"warning: {line}\n" in captured.err
    assert result["config"]["backend"] == "hf" and result["config"]["backend_requested"] == "auto"
    rows = {r["label"]: r for r in result["overall"]["rows"]}
    assert set(rows) == {"ar", "draft k=2", "hf-ar"}
    assert all(r["lossless"] for r in rows.values())


def test_backend_option(neox_pair, tiny_family, tmp_path, capsys):
    common = ["--prompts", str(neox_pair / "prompts.jsonl"), "--methods", "ar", "--max-new-tokens", "4",
              "--repeats", "1", "--quiet"]
    # native asked for explicitly: a clean one-line error
    args = parse(["--model", str(neox_pair / "target"), "--backend", "native", *common])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    # a native-capable model on transformers, on request
    out_json = tmp_path / "hf.json"
    args = parse(["--model", str(tiny_family["target"]), "--backend", "hf", "--json", str(out_json), *common])
    assert args.func(args) == 0
    result = json.loads(out_json.read_text())
    assert result["config"]["backend"] == "hf" and result["config"]["backend_requested"] == "hf"
    assert "--backend hf" in result["config"]["command"]


def test_warns_when_a_method_is_slower_than_plain():
    rows = [
        {"label": "ar", "speculative": False, "speedup": 1.0},
        {"label": "hf-ar", "speculative": False, "speedup": 0.8},  # a reference, not a method to pick
        {"label": "draft k=3", "speculative": True, "speedup": 0.46},
        {"label": "draft k=2", "speculative": True, "speedup": 1.3},
    ]
    lines = slower_than_plain(rows)
    assert len(lines) == 1 and "draft k=3" in lines[0] and "slower than plain decoding" in lines[0]
    assert "\n" not in lines[0]
    # faster overall but slower in one category: named, with the category
    groups = [{"category": "short", "rows": [dict(rows[3], speedup=1.6)]},
              {"category": "long", "rows": [dict(rows[3], speedup=0.9)]}]
    lines = slower_than_plain(rows[3:], groups)
    assert lines == ["draft k=2 is slower than plain decoding (ar) on long 0.90x (1.30x over all categories)"]


def test_warns_about_a_prompt_the_target_ends_at_once():
    """The long category once measured one of its two quick prompts: the target ended the
    other at once (0 tokens: no ratio), and nothing said so."""
    def runs(*counts):
        return [{"new_tokens": n} for n in counts]

    groups = [{"category": "long", "rows": [
        {"label": "ar", "runs_by_prompt": {"long-a": runs(128, 128), "long-b": runs(0, 0)}},
        {"label": "draft k=4", "runs_by_prompt": {"long-a": runs(128, 128), "long-b": runs(0, 0)}}]},
        {"category": "short", "rows": [{"label": "ar", "runs_by_prompt": {"s": runs(3, 0)}}]}]
    lines = unmeasured_prompts(groups)
    assert len(lines) == 1 and lines[0].startswith("long: ar wrote no token after prompt long-b")
