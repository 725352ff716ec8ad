"""An EAGLE drafter narrower than its target (a draft model's shape, ``--from-draft``): it
starts as the draft model it is built from, greedy output stays plain decoding's, and the
trainer builds, saves and reloads it. (Its unrolled training steps against its drafting,
and its C chain against its Python levels: ``tests/test_eagle.py``.)"""

from __future__ import annotations

import json

import pytest
import torch

from quickdraft.cli import main
from quickdraft.drafters import DraftOptions
from quickdraft.models import cpu_kernels
from quickdraft.models.config import ModelConfig
from quickdraft.models.eagle import EagleHead, load_eagle
from quickdraft.models.transformer import Transformer

NARROW = {"hidden_size": 16, "n_heads": 2, "n_kv_heads": 1, "intermediate_size": 40}


def tiny(hidden: int, layers: int, heads: int, kv_heads: int, seed: int, theta: float = 10000.0) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(family="llama", model_type="llama", vocab_size=50, hidden_size=hidden, n_layers=layers,
                      n_heads=heads, n_kv_heads=kv_heads, head_dim=8, intermediate_size=2 * hidden + 8,
                      max_position_embeddings=64, tie_word_embeddings=True, rope_theta=theta)
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
    with pytest.raises(ValueError, match="rope theta 500"):  # other positions: it would not be the draft
        head.from_draft(tiny(16, 1, 2, 1, 2, theta=500.0), target)
    with pytest.raises(ValueError, match="heads of the target's 8"):
        EagleHead(target, None, {**NARROW, "n_heads": 4})


def test_greedy_narrow_eagle_equals_plain_decoding_in_the_cli(capsys):
    """The embedded target's shipped drafter (256 wide against 448): trees (the Python
    levels with a tree mask) and the chain, through the CLI, and sampled trees' tokens."""
    from quickdraft.drafters.eagle import shipped_eagle
    from quickdraft.models.eagle import read_eagle_config
    from quickdraft.models.lm import load_model
    from quickdraft.models.loading import resolve_model_dir

    shipped = shipped_eagle(load_model(resolve_model_dir("qd-stdlib-target")))
    assert read_eagle_config(shipped).layer["hidden_size"] == 256
    common = ["generate", "--max-new-tokens", "48", "--json", "--prompt", "def median(values):\n"]
    assert main([*common, "--method", "ar"]) == 0
    plain = json.loads(capsys.readouterr().out)["token_ids"]
    for extra in (["--tree", "dynamic:6"], ["--tree", "2,2,1"], ["-k", "5"]):
        assert main([*common, "--method", "eagle", *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["token_ids"] == plain and out["stats"]["mean_accepted_tokens"] > 1.5


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

    assert train("narrow", "--from-draft", str(tmp_path / "draft"), "--draft-vocab", "0", "--blind-share", "0.5") == 0
    report = json.loads((tmp_path / "narrow" / "train_report.json").read_text())
    assert report["layer"]["hidden_size"] == 32 and report["init"]["draft"] and len(report["heldout_agreement"]) == 2
    assert report["blind_share"] == 0.5
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
    # EAGLE-3's fusion: --init with more target layers starts as it was (the new layers'
    # share of the map at zero), then learns from them; saved, it reads them and stays lossless.
    assert train("fused", "--init", str(tmp_path / "narrow"), "--feature-layers", "1,2") == 0
    fused = json.loads((tmp_path / "fused" / "train_report.json").read_text())
    assert fused["feature_layers"] == [1, 2] and fused["init_heldout_agreement"] == report["heldout_agreement"]
    assert load_eagle(tmp_path / "fused", target).feature_layers == (1, 2)

    def reads_both_layers_losslessly(heads: str) -> None:
        eagle = SpeculativeGenerator.from_pretrained(str(tmp_path / "target"), method="eagle",
                                                     options=DraftOptions(heads=str(tmp_path / heads)))
        assert eagle.drafter.reads_hidden == (1, 2)
        for prompt in ["def f3(x):\n", "def f6(x):\n    return x"]:
            assert eagle.generate(prompt, max_new_tokens=24, num_speculative_tokens=3).token_ids == \
                plain.generate(prompt, max_new_tokens=24).token_ids

    reads_both_layers_losslessly("fused")
    capsys.readouterr()
    for extra, says in [(("--init", str(tmp_path / "fused"), "--feature-layers", "1"), "keep them"),
                        (("--from-draft", str(tmp_path / "draft"), "--feature-layers", "1,3"), "from 1 to"),
                        (("--feature-layers", "2,1"), "increasing"),
                        (("--feature-layers", "1,x"), "separated by commas"),
                        (("--kind", "medusa", "--feature-layers", "1,2"), "is for --kind eagle")]:
        assert train("bad", *extra) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--feature-layers" in err and says in err and "Traceback" not in err
    assert train("again", "--init", str(tmp_path / "narrow"), "--blind-share", "1") == 2
    assert "--blind-share 1.0: a share of the windows" in capsys.readouterr().err
    # At the target's width too: a drafter of the final state alone, widened to layers 1
    # and 2, starts as it was (its map passes the final state through) and stays lossless.
    assert train("wide", "--draft-vocab", "0") == 0
    assert train("wide-fused", "--init", str(tmp_path / "wide"), "--feature-layers", "1,2") == 0
    wide = json.loads((tmp_path / "wide" / "train_report.json").read_text())
    wide_fused = json.loads((tmp_path / "wide-fused" / "train_report.json").read_text())
    assert wide_fused["init_heldout_agreement"] == pytest.approx(wide["heldout_agreement"], abs=0.01)
    head = load_eagle(tmp_path / "wide-fused", target)
    assert head.fused and not head.own_width and head.feature_layers == (1, 2)
    reads_both_layers_losslessly("wide-fused")


@pytest.mark.skipif(cpu_kernels.library() is None, reason="needs our compiled CPU kernels (x86 AVX2, a C compiler)")  # keys bit for bit
def test_the_first_round_drafts_blind_and_leaves_nothing_behind(monkeypatch):
    """Before the prefill a chain drafts from the prompt with zero features and the prefill
    pass verifies it: the first pass yields more than one token, greedy output stays plain
    decoding's, and the prompt's slots in the drafter's cache end as the target's features
    wrote them (the same as when the first round does not draft)."""
    from quickdraft.decoding.drafter import EMPTY
    from quickdraft.decoding.engine import decode
    from quickdraft.decoding.stats import GenerationStats
    from quickdraft.decoding.stopping import StopConditions
    from quickdraft.drafters.eagle import EagleDrafter, load_eagle_head
    from quickdraft.drafters.shapes import StaticTree
    from quickdraft.pair import load_pair

    pair = load_pair(None, need_draft=False)
    head = load_eagle_head(pair.target, None)
    firsts = []
    for text in ("def median(values):\n", "for i in range(10):\n    print(i)\n"):
        prompt = torch.tensor(pair.tokenizer(text)["input_ids"])
        plain = [t for s in decode(pair.target, prompt, StopConditions(48)) for t in s.tokens]
        runs = []
        for blind in (True, False):
            if not blind:
                monkeypatch.setattr(EagleDrafter, "_draft_blind", lambda self, sequence, k: EMPTY)
            stats = GenerationStats()
            drafter = EagleDrafter(pair.target, head, StaticTree((1,) * 6, sample=False))
            steps = list(decode(pair.target, prompt, StopConditions(48), drafter=drafter, num_speculative_tokens=6,
                                stats=stats))
            assert [t for s in steps for t in s.tokens] == plain
            runs.append((stats.prefill_tokens, drafter.cache.k[..., : prompt.numel(), :].clone()))
            monkeypatch.undo()
        assert runs[1][0] == 1
        torch.testing.assert_close(runs[0][1], runs[1][1], rtol=1e-5, atol=1e-5)
        firsts.append(runs[0][0])
    assert max(firsts) > 1


def test_blind_windows_read_zero_features():
    """``--blind-share``: a blind window's loss does not depend on the target's features
    (it is read with zero ones, as the first round drafts), a seeing window's does."""
    from quickdraft.train.eagle import eagle_loss

    target = tiny(32, 2, 4, 2, 0)
    head = EagleHead(target, None, NARROW)
    torch.manual_seed(5)
    tokens, t_logits, features = torch.randint(0, 50, (2, 10)), torch.randn(2, 10, 50), torch.randn(2, 10, 32)
    blind = torch.tensor([True, False])

    def loss(f):
        return eagle_loss(head, target, tokens, t_logits, f, 2, 0.5, 1.0, blind)[0].item()

    moved = [features.clone(), features.clone()]
    moved[0][0] += torch.randn(10, 32)
    moved[1][1] += torch.randn(10, 32)
    assert loss(moved[0]) == pytest.approx(loss(features), abs=1e-6)
    assert loss(moved[1]) != pytest.approx(loss(features), abs=1e-4)
