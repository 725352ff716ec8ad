"""An EAGLE drafter narrower than its target (a draft model's shape, ``--from-draft``): it
starts as the draft model it is built from, its unrolled training steps compute what its
drafting computes, its C chain drafts what its Python levels draft, greedy output stays
plain decoding's, and the trainer builds, saves and reloads it."""

from __future__ import annotations

import json

import pytest
import torch

from quickdraft.cli import main
from quickdraft.drafters import DraftOptions
from quickdraft.models.config import ModelConfig
from quickdraft.models.eagle import EagleHead, load_eagle, save_eagle
from quickdraft.models.transformer import Transformer

NARROW = {"hidden_size": 16, "n_heads": 2, "n_kv_heads": 1, "intermediate_size": 40}


def tiny(hidden: int, layers: int, heads: int, kv_heads: int, seed: int) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(family="llama", model_type="llama", vocab_size=50, hidden_size=hidden, n_layers=layers,
                      n_heads=heads, n_kv_heads=kv_heads, head_dim=8, intermediate_size=2 * hidden + 8,
                      max_position_embeddings=64, tie_word_embeddings=True)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
        model.norm.weight.fill_(1.0)
    return model


def test_a_narrow_drafter_starts_as_its_draft_model():
    """``from_draft``: before training, every unrolled step scores what the draft model
    scores at that position (the feature is ignored, the embedding passed through), so it
    proposes the draft's tokens; a draft of another shape is a one-line ValueError."""
    target, draft = tiny(32, 2, 4, 2, 0), tiny(16, 1, 2, 1, 1)
    head = EagleHead(target, None, NARROW)
    head.from_draft(draft, target)
    tokens = torch.randint(0, 50, (2, 12))
    positions = torch.arange(12)[None].expand(2, -1)
    with torch.no_grad():
        features = target(tokens, positions, target.new_cache(2, 12)).hidden
        expected = draft(tokens, positions, draft.new_cache(2, 12)).logits
        for k, out in enumerate(head.unrolled(tokens, features, target, 3)):
            torch.testing.assert_close(head.logits(out[:, k:], target), expected[:, k:], atol=1e-4, rtol=1e-4)
    assert head.layer_shape == NARROW and head.feature_size == 16 and head.draft_vocab == 50
    with pytest.raises(ValueError, match="one-layer draft model of its layer's shape"):
        head.from_draft(tiny(16, 2, 2, 1, 2), target)
    with pytest.raises(ValueError, match="heads of the target's 8"):
        EagleHead(target, None, {**NARROW, "n_heads": 4})


def test_narrow_unrolled_steps_compute_what_drafting_computes():
    """Step k at slot p of the training-time test == feeding slots 0..p-k with the target's
    features mapped to the layer's width (``from_target``), then a chain of k nodes each fed
    its parent's output at that width, through the drafter's KV cache and tree mask."""
    target = tiny(32, 2, 4, 2, 0)
    torch.manual_seed(3)
    head = EagleHead(target, torch.arange(0, 50, 2), NARROW)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
    head.eval()
    length, steps = 9, 4
    tokens, features = torch.randint(0, 50, (1, length)), torch.randn(1, length, 32)
    with torch.no_grad():
        unrolled = head.unrolled(tokens, features, target, steps)
        mapped = head.from_target(features[0])
        assert mapped.shape == (length, 16)
        for k in range(steps):
            for p in range(k, length):
                cache, n = head.new_cache(32), p - k + 1
                fed = torch.cat([torch.zeros(1, 16), mapped[: n - 1]])
                out = head.extend(tokens[0, :n], fed, target, cache, 0, 0)[-1]
                for d in range(k):
                    slot = torch.tensor([n + d])
                    mask = torch.ones(1, 1, n + d + 1, dtype=torch.bool)
                    out = head.extend(tokens[0, n + d : n + d + 1], out[None], target, cache, slot, slot, mask)[0]
                torch.testing.assert_close(out, unrolled[k][0, p], atol=1e-5, rtol=1e-4)
    logits = head.logits(unrolled[0], target)
    assert torch.isinf(logits[..., 1::2]).all() and torch.isfinite(logits[..., ::2]).all()


@pytest.fixture(scope="module")
def embedded_narrow(tmp_path_factory):
    """The embedded target's drafter built from the embedded draft, untrained (it proposes
    the draft's tokens: accepted often, so the chain is exercised), saved as a directory."""
    from quickdraft.train.exit_head import load_native_teacher

    target = load_native_teacher("qd-stdlib-target")[0]
    draft = load_native_teacher("qd-stdlib-draft")[0]
    head = EagleHead(target, None, {name: getattr(draft.config, name) for name in NARROW})
    head.from_draft(draft, target)
    out = tmp_path_factory.mktemp("narrow")
    save_eagle(head, target, "qd-stdlib-target", out)
    return out


def test_the_narrow_chain_in_one_call_drafts_what_its_python_levels_draft(embedded_narrow, monkeypatch):
    """Beside the embedded target (448 wide) a 256-wide drafter: the C chain (its own
    embedding and norm) drafts the Python levels' tokens, accepted as often, and greedy output
    is plain decoding's either way."""
    from quickdraft.decoding.engine import decode
    from quickdraft.decoding.stats import GenerationStats
    from quickdraft.decoding.stopping import StopConditions
    from quickdraft.drafters.eagle import EagleDrafter, load_eagle_head
    from quickdraft.drafters.shapes import StaticTree
    from quickdraft.models import cpu_kernels
    from quickdraft.pair import load_pair

    if cpu_kernels.library() is None:
        pytest.skip("needs the compiled CPU kernels")
    pair = load_pair(None, need_draft=False)
    head = load_eagle_head(pair.target, str(embedded_narrow))
    assert head.own_width and head.feature_size == 256
    chained = EagleHead.greedy_chain
    prompt = torch.tensor(pair.tokenizer("import os\n\n\ndef walk(root):\n")["input_ids"])
    plain = [t for s in decode(pair.target, prompt, StopConditions(64)) for t in s.tokens]
    runs = []
    for in_c in (True, False):
        ran_in_c = []

        def chain(self, *args, in_c=in_c, ran_in_c=ran_in_c):
            tokens = chained(self, *args) if in_c else None
            ran_in_c.append(tokens is not None)
            return tokens

        monkeypatch.setattr(EagleHead, "greedy_chain", chain)
        stats = GenerationStats()
        drafter = EagleDrafter(pair.target, head, StaticTree((1,) * 6, sample=False))
        steps = list(decode(pair.target, prompt, StopConditions(64), drafter=drafter, num_speculative_tokens=6,
                            stats=stats))
        assert [t for step in steps for t in step.tokens] == plain
        assert ran_in_c and all(ran_in_c) == in_c
        runs.append(([s.tokens for s in steps], stats.mean_accepted_tokens))
    assert runs[0] == runs[1] and runs[0][1] > 2


def test_greedy_narrow_eagle_equals_plain_decoding_in_the_cli(embedded_narrow, capsys):
    """Trees (the Python levels with a tree mask) and the default chain, through the CLI."""
    common = ["generate", "--max-new-tokens", "48", "--json", "--prompt", "def median(values):\n"]
    assert main([*common, "--method", "ar"]) == 0
    plain = json.loads(capsys.readouterr().out)["token_ids"]
    for extra in (["--tree", "dynamic:6"], ["--tree", "2,2,1"], ["-k", "5"]):
        assert main([*common, "--method", "eagle", "--heads", str(embedded_narrow), *extra]) == 0
        assert json.loads(capsys.readouterr().out)["token_ids"] == plain


def test_train_heads_from_a_draft(tmp_path, capsys):
    """`train heads --kind eagle --from-draft DRAFT`: the drafter has the draft's width, its
    held-out agreement before training is the draft's own (it starts as the draft), the card
    says so, it reloads and stays lossless; --init beside it, or a draft of another shape, is
    one line and exit 2."""
    from conftest import build_tokenizer, save_llama
    from transformers import LlamaConfig, LlamaForCausalLM

    from quickdraft.generator import SpeculativeGenerator
    from quickdraft.train.exit_head import load_native_teacher

    tok = build_tokenizer(tmp_path / "target")
    save_llama(tmp_path / "target", len(tok), layers=2, hidden=64, seed=0, eos=tok.eos_token_id, scale=20.0)
    for name, layers in (("draft", 1), ("deep", 2)):  # the target's 16-wide heads
        torch.manual_seed(1)
        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                          eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, tie_word_embeddings=True)
        LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path / name, safe_serialization=True)
        tok.save_pretrained(tmp_path / name)
    (tmp_path / "data").mkdir()
    for i in range(8):
        (tmp_path / "data" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + len(str(x))\n" * 12)

    def train(out, *extra):
        return main(["train", "heads", "--kind", "eagle", "--ttt-steps", "2", "--target", str(tmp_path / "target"),
                     "--data", str(tmp_path / "data"), "--out", str(tmp_path / out), "--steps", "4", "--seq-len",
                     "32", "--batch-size", "2", "--lr", "1e-2", "--warmup", "1", "--eval-tokens", "256",
                     "--threads", "1", "--probe-every", "0", "--no-progress", *extra])

    assert train("narrow", "--from-draft", str(tmp_path / "draft"), "--draft-vocab", "0") == 0
    report = json.loads((tmp_path / "narrow" / "train_report.json").read_text())
    assert report["layer"]["hidden_size"] == 32 and report["init"]["draft"] and len(report["heldout_agreement"]) == 2
    assert "Started as the draft model" in (tmp_path / "narrow" / "README.md").read_text()
    target = load_native_teacher(str(tmp_path / "target"))[0]
    draft = load_native_teacher(str(tmp_path / "draft"))[0]
    # Scored before training, it agreed with the target as often as the draft model's own greedy token.
    window = torch.as_tensor(tok("def f1(x):\n    return x * 1 + len(str(x))\n" * 3)["input_ids"][:32])[None]
    with torch.no_grad():
        greedy = target(window, torch.arange(window.shape[1])[None], target.new_cache(1, 32)).logits.argmax(-1)
        own = draft(window, torch.arange(window.shape[1])[None], draft.new_cache(1, 32)).logits.argmax(-1)
        start = EagleHead(target, None, report["layer"])
        start.from_draft(draft, target)
        out = start.unrolled(window, target(window, torch.arange(32)[None], target.new_cache(1, 32)).hidden, target, 1)
        assert torch.equal(start.logits(out[0], target).argmax(-1), own)
    assert 0 <= float((own == greedy).float().mean()) <= 1
    head = load_eagle(tmp_path / "narrow", target)
    assert head.own_width and head.feature_size == 32
    plain = SpeculativeGenerator.from_pretrained(str(tmp_path / "target"), method="ar")
    eagle = SpeculativeGenerator.from_pretrained(str(tmp_path / "target"), method="eagle",
                                                 options=DraftOptions(heads=str(tmp_path / "narrow")))
    for prompt in ["def f3(x):\n", "def f6(x):\n    return x"]:
        assert eagle.generate(prompt, max_new_tokens=24, num_speculative_tokens=3).token_ids == \
            plain.generate(prompt, max_new_tokens=24).token_ids
    capsys.readouterr()
    assert train("both", "--from-draft", str(tmp_path / "draft"), "--init", str(tmp_path / "narrow")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--from-draft" in err and "Traceback" not in err
    assert train("narrow2", "--from-draft", str(tmp_path / "deep")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "one-layer draft model" in err
    assert train("again", "--init", str(tmp_path / "narrow"), "--draft-vocab", "8") == 2
    assert "rows are its own" in capsys.readouterr().err
