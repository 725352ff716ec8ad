"""The EAGLE drafter: training's unrolled steps compute exactly what drafting computes, its
trees are verified losslessly (greedy equality; sampled output distributed as the
target's, where a wrong rule fails the same test), and bad input is one line."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from test_sampling_exact import empirical_pvalue, tiny_lm
from test_trees_exact import MSSWithoutResidualUpdate

from quickdraft.cli import main
from quickdraft.decoding.drafter import EMPTY
from quickdraft.decoding.sampling import SamplingParams
from quickdraft.drafters import DraftOptions, make_drafter
from quickdraft.drafters.eagle import EagleDrafter
from quickdraft.drafters.shapes import DynamicTree, StaticTree
from quickdraft.drafters.shipped import HEADS_DIR
from quickdraft.generator import SpeculativeGenerator
from quickdraft.models.config import ModelConfig
from quickdraft.models.eagle import EagleHead, load_eagle, save_eagle
from quickdraft.models.loading import CheckpointError
from quickdraft.models.transformer import Transformer

TARGET = tiny_lm(0, 3.0)


def random_head(target: Transformer, vocab_ids=None, seed: int = 0, std: float = 0.3, layer=None,
                feature_layers=None) -> EagleHead:
    torch.manual_seed(seed)
    head = EagleHead(target, vocab_ids, layer, feature_layers)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, std)
    return head.eval()


NARROW = {"hidden_size": 16, "n_heads": 2, "n_kv_heads": 1, "intermediate_size": 40}


@pytest.mark.parametrize("layer, feature_layers", [(None, None), (NARROW, None), (NARROW, (1, 2)), (None, (1, 2))],
                         ids=["target-width", "narrow", "narrow-fused", "target-width-fused"])
def test_unrolled_training_steps_compute_what_drafting_computes(layer, feature_layers):
    """Step k at slot p of the training-time test == feeding slots 0..p-k with the target's
    features (mapped to the layer's width by ``from_target`` for a narrow drafter, several
    layers' states side by side for a fused one), then a chain of k nodes each fed its
    parent's output, through the drafter's KV cache and tree mask (grouped-query attention
    and a reduced vocabulary included)."""
    torch.manual_seed(0)
    cfg = ModelConfig(family="llama", model_type="llama", vocab_size=50, hidden_size=32, n_layers=2, n_heads=4,
                      n_kv_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=64)
    target = Transformer(cfg).eval()
    head = random_head(target, torch.arange(0, 50, 2), std=0.2, layer=layer, feature_layers=feature_layers)
    length, steps = 9, 4
    tokens = torch.randint(0, 50, (1, length))
    features = torch.randn(1, length, 32 * len(feature_layers or (2,)))
    with torch.no_grad():
        unrolled = head.unrolled(tokens, features, target, steps)
        mapped = head.from_target(features[0])
        assert mapped.shape == (length, head.feature_size)
        for k in range(steps):
            for p in range(k, length):
                cache, n = head.new_cache(32), p - k + 1
                fed = torch.cat([torch.zeros(1, head.feature_size), mapped[: n - 1]])
                out = head.extend(tokens[0, :n], fed, target, cache, 0, 0)[-1]
                for d in range(k):
                    slot = torch.tensor([n + d])
                    mask = torch.ones(1, 1, n + d + 1, dtype=torch.bool)
                    out = head.extend(tokens[0, n + d : n + d + 1], out[None], target, cache, slot, slot, mask)[0]
                torch.testing.assert_close(out, unrolled[k][0, p], atol=1e-5, rtol=1e-4)
    logits = head.logits(unrolled[0], target)
    assert torch.isinf(logits[..., 1::2]).all() and torch.isfinite(logits[..., ::2]).all()


def test_fused_layers_at_the_target_width_end_with_the_final_state():
    """A drafter of the target's width stands for its final state, so fusing other layers
    keeps that one, last; its map starts as the final state's identity: the fused drafter
    computes what the drafter of the final state alone does."""
    from quickdraft.models.eagle import check_feature_layers
    from quickdraft.models.quant_linear import (
        Int4Linear,
        Int8Linear,
        native_kernels,
        quantize_drafter,
    )

    with pytest.raises(ValueError, match="end them with 3"):
        check_feature_layers((1, 2), 3, own_width=False)
    assert check_feature_layers((1, 3), 3, own_width=False) == (1, 3)
    assert check_feature_layers((1, 2), 3, own_width=True) == (1, 2)
    torch.manual_seed(0)
    cfg = ModelConfig(family="llama", model_type="llama", vocab_size=50, hidden_size=32, n_layers=2, n_heads=4,
                      n_kv_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=64)
    target = Transformer(cfg).eval()
    alone = random_head(target, torch.arange(0, 50, 2), std=0.2)
    fused = EagleHead(target, torch.arange(0, 50, 2), None, (1, 2)).eval()
    state = fused.state_dict()
    state.update(alone.state_dict())
    fused.load_state_dict(state)
    tokens, final = torch.randint(0, 50, (1, 9)), torch.randn(1, 9, 32) * 5
    both = torch.cat([torch.randn(1, 9, 32), final], dim=-1)
    with torch.no_grad():
        for a, b in zip(alone.unrolled(tokens, final, target, 3), fused.unrolled(tokens, both, target, 3)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    if native_kernels():  # beside an int4 target the layers go int4, the map (an identity at first) int8
        beside = torch.nn.Sequential(Int4Linear.from_weight(torch.randn(32, 32)))
        assert quantize_drafter(fused, beside) > 1
        assert isinstance(fused.feature_in, Int8Linear) and isinstance(fused.fc, Int4Linear)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [DynamicTree(4, branch=2), StaticTree((2, 2)), StaticTree((1, 1), sample=False)],
                         ids=["dynamic", "sampled", "top-chain"])
def test_sampled_eagle_trees_match_the_target_distribution(shape):
    """Dynamic trees have one-hot q; static trees sample from the drafter (q over a reduced
    vocabulary, zero elsewhere); a chain of top tokens (one-hot q) drafts blind before the
    prefill too: all exact under the engine's tree rule."""
    drafter = EagleDrafter(TARGET, random_head(TARGET.model, torch.tensor([0, 1, 3])), shape)
    assert empirical_pvalue(TARGET, drafter, SamplingParams(temperature=1.0), n_samples=2000) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("shape", [StaticTree((2, 2)), StaticTree((1, 1), sample=False)], ids=["sampled", "top-chain"])
def test_a_wrong_rule_fails_the_same_eagle_test(shape):
    drafter = EagleDrafter(TARGET, random_head(TARGET.model, torch.tensor([0, 1, 3])), shape)
    assert empirical_pvalue(TARGET, drafter, SamplingParams(temperature=1.0), MSSWithoutResidualUpdate,
                            n_samples=500) < 1e-6


@pytest.fixture(scope="module")
def tiny_eagle(tiny_family, tmp_path_factory):
    from quickdraft.models.lm import load_model

    target = load_model(tiny_family["target"])
    out = tmp_path_factory.mktemp("eagle")
    save_eagle(random_head(target.model, std=0.05), target.model, "tiny-target", out)
    return out


def test_greedy_eagle_equals_plain_decoding_in_the_cli(tiny_family, tiny_eagle, capsys):
    common = ["generate", "--model", str(tiny_family["target"]), "--max-new-tokens", "40", "--json"]
    for prompt in ["def add(a, b):", "for i in range(10):\n    print(i"]:
        assert main([*common, "--prompt", prompt, "--method", "ar"]) == 0
        plain = json.loads(capsys.readouterr().out)
        for tree in ["dynamic:6", "2,2,1"]:
            assert main([*common, "--prompt", prompt, "--method", "eagle", "--heads", str(tiny_eagle),
                         "--tree", tree]) == 0
            eagle = json.loads(capsys.readouterr().out)
            assert eagle["token_ids"] == plain["token_ids"]
            assert eagle["settings"]["method"] == "eagle"


def test_eagle_without_a_drafter_or_with_another_targets_is_one_line(tiny_family, tiny_eagle, capsys):
    common = ["generate", "--model", str(tiny_family["target"]), "--prompt", "x", "--max-new-tokens", "4"]
    assert main([*common, "--method", "eagle"]) != 0
    err = capsys.readouterr().err
    assert "needs an EAGLE drafter" in err and "train heads --kind eagle" in err and "Traceback" not in err
    assert main([*common, "--method", "eagle", "--heads", str(tiny_eagle), "--backend", "hf"]) != 0
    assert "native runtime" in capsys.readouterr().err
    from quickdraft.models.lm import load_model

    other = load_model(tiny_family["unrelated"])
    with pytest.raises(CheckpointError, match="another target"):
        load_eagle(tiny_eagle, other.model)
    with pytest.raises(CheckpointError, match="no EAGLE drafter"):
        make_drafter("eagle", None, other.vocab_size, DraftOptions(heads=str(tiny_family["target"])), target=other)


def test_train_heads_eagle_end_to_end_resume_and_lossless(tmp_path, capsys):
    """`train heads --kind eagle` on a tiny target: files, card, per-step agreement,
    --resume, and the trained drafter is lossless through the API. (Acceptance is the
    shipped drafter's test: this random target's greedy tokens mostly lie outside the
    64-token draft vocabulary of its text.)"""
    from conftest import build_tokenizer, save_llama

    from quickdraft.generator import SpeculativeGenerator

    tok = build_tokenizer(tmp_path / "target")
    save_llama(tmp_path / "target", len(tok), layers=2, hidden=64, seed=0, eos=tok.eos_token_id, scale=20.0)
    (tmp_path / "data").mkdir()
    for i in range(8):
        (tmp_path / "data" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + len(str(x))\n" * 12)
    out = tmp_path / "eagle"

    def train(*extra):
        return main(["train", "heads", "--kind", "eagle", "--ttt-steps", "3", "--draft-vocab", "64", "--target",
                     str(tmp_path / "target"), "--data", str(tmp_path / "data"), "--out", str(out), "--steps", "12",
                     "--seq-len", "32", "--batch-size", "2", "--lr", "1e-2", "--warmup", "2", "--ckpt-every", "6",
                     "--eval-tokens", "256", "--threads", "1", "--no-progress", *extra])

    assert train("--steps", "6") == 0
    assert {"config.json", "model.safetensors", "README.md", "train_log.jsonl", "loss_curve.png",
            "train_report.json"} <= {p.name for p in out.iterdir()}
    assert "EAGLE-style feature drafter" in (out / "README.md").read_text()
    assert train("--resume") == 0
    steps = [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert steps[-1] == 12 and steps == sorted(steps)
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert {"ce0", "ce2"} <= set([r for r in records if r.get("event") == "train"][-1])
    report = json.loads((out / "train_report.json").read_text())
    assert len(report["heldout_agreement"]) == 3 and report["draft_vocab"] == 64
    assert train("--resume", "--ttt-steps", "2") == 2 and "other settings" in capsys.readouterr().err
    plain = SpeculativeGenerator.from_pretrained(str(tmp_path / "target"), method="ar")
    eagle = SpeculativeGenerator.from_pretrained(str(tmp_path / "target"), method="eagle",
                                                 options=DraftOptions(heads=str(out)))
    # The CPU default: a chain of up to 8, as long as the cost model finds pays (measured on
    # first use, cached: docs/heads/README.md).
    assert eagle.drafter.name == "eagle(1,1,1,1,1,1,1,1)" and eagle.drafter.k_by_cost_model
    assert eagle.num_speculative_tokens == 6  # the API's default until resolve_k asks the cost model
    k, source = eagle.resolve_k()
    assert 0 <= k <= 8 and source.startswith("cost model") and eagle.resolve_k()[0] == k
    for prompt in ["def f3(x):\n", "def f6(x):\n    return x"]:
        got = eagle.generate(prompt, max_new_tokens=32)
        assert got.token_ids == plain.generate(prompt, max_new_tokens=32).token_ids
    # draft_vocab.json ranks its 64 rows by the training text; --draft-vocab N keeps the N most frequent.
    record = json.loads((out / "draft_vocab.json").read_text())
    stored = eagle.drafter.head.vocab_ids.tolist()
    assert sorted(record["ranking"]) == sorted(stored) and record["size"] == 64
    small = SpeculativeGenerator.from_pretrained(str(tmp_path / "target"), method="eagle",
                                                 options=DraftOptions(heads=str(out)), draft_vocab=16)
    kept = small.drafter.head.vocab_ids.tolist()
    assert sorted(kept) == sorted(record["ranking"][:16]) and kept == [i for i in stored if i in kept]
    for prompt in ["def f3(x):\n"]:
        got = small.generate(prompt, max_new_tokens=32)
        assert got.token_ids == plain.generate(prompt, max_new_tokens=32).token_ids
    with pytest.raises(ValueError, match="between 0 .all. and 64"):
        SpeculativeGenerator.from_pretrained(str(tmp_path / "target"), method="eagle",
                                             options=DraftOptions(heads=str(out)), draft_vocab=65)


def test_a_restricted_head_keeps_its_rows_in_their_stored_order():
    """restrict_vocab (--draft-vocab): the kept tokens' rows, in the stored order (the first
    maximum among them stays the same token), the same scores for them; one-line errors for
    a head without rows of its own or no token in common."""
    cfg = ModelConfig(family="llama", model_type="llama", vocab_size=50, hidden_size=32, n_layers=1, n_heads=4,
                      n_kv_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=64)
    target = Transformer(cfg).eval()
    head = random_head(target, torch.tensor([2, 5, 9, 11, 14, 17]))
    out = torch.randn(3, target.config.hidden_size)
    with torch.no_grad():
        before = head.logits(out, target)
        head.restrict_vocab(torch.tensor([17, 2, 9, 30]))
        after = head.logits(out, target)
    assert head.vocab_ids.tolist() == [2, 9, 17] and head.draft_vocab == 3
    torch.testing.assert_close(after[:, [2, 9, 17]], before[:, [2, 9, 17]])
    assert torch.isneginf(after[:, [5, 11, 14]]).all()
    with pytest.raises(ValueError, match="no rows of its own"):
        random_head(target).restrict_vocab(torch.tensor([1]))
    with pytest.raises(ValueError, match="none of the given tokens"):
        random_head(target, torch.tensor([2, 5])).restrict_vocab(torch.tensor([3]))


def test_train_heads_init_starts_from_the_given_weights(tmp_path, capsys):
    """`--init DIR` trains on from heads trained before: scored before training on, they
    agree with the target exactly as they did when saved (fresh weights would not); an EAGLE
    drafter keeps its draft vocabulary, and --draft-vocab widens it; a drafter of another
    kind, or --init for a prophet, is one line and exit 2."""
    from conftest import build_tokenizer, save_llama

    tok = build_tokenizer(tmp_path / "target")
    save_llama(tmp_path / "target", len(tok), layers=2, hidden=64, seed=0, eos=tok.eos_token_id, scale=20.0)
    (tmp_path / "data").mkdir()
    for i in range(8):
        (tmp_path / "data" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + len(str(x))\n" * 12)

    def train(kind, out, *extra):
        return main(["train", "heads", "--kind", kind, "--ttt-steps", "2", "--num-heads", "2", "--target",
                     str(tmp_path / "target"), "--data", str(tmp_path / "data"), "--out", str(tmp_path / out),
                     "--steps", "4", "--seq-len", "32", "--batch-size", "2", "--lr", "1e-2", "--warmup", "1",
                     "--eval-tokens", "256", "--threads", "1", "--probe-every", "0", "--no-progress", *extra])

    def report(out):
        return json.loads((tmp_path / out / "train_report.json").read_text())

    for kind in ["eagle", "medusa"]:
        assert train(kind, f"{kind}0", *(["--draft-vocab", "48"] if kind == "eagle" else [])) == 0
        assert train(kind, f"{kind}1", "--init", str(tmp_path / f"{kind}0")) == 0
        first, second = report(f"{kind}0"), report(f"{kind}1")
        assert second["init_heldout_agreement"] == first["heldout_agreement"]
        assert second["init"]["sha256"] == hashlib.sha256((tmp_path / f"{kind}0" / "model.safetensors").read_bytes()).hexdigest()
        assert "before (`--init " in (tmp_path / f"{kind}1" / "README.md").read_text()
    from quickdraft.train.exit_head import load_native_teacher

    target = load_native_teacher(str(tmp_path / "target"))[0]  # unpacked, as the trainer loads it
    start = load_eagle(tmp_path / "eagle0", target)
    assert torch.equal(load_eagle(tmp_path / "eagle1", target).vocab_ids, start.vocab_ids)
    assert train("eagle", "eagle2", "--init", str(tmp_path / "eagle0"), "--draft-vocab", "64") == 0
    widened = load_eagle(tmp_path / "eagle2", target)
    assert widened.draft_vocab > start.draft_vocab and set(start.vocab_ids.tolist()) <= set(widened.vocab_ids.tolist())
    rows = target.lm_head.weight[widened.vocab_ids].bfloat16().float()  # the target's rows, stored in bf16
    assert torch.equal(widened.vocab_head.weight, rows)
    capsys.readouterr()
    assert train("eagle", "eagle3", "--init", str(tmp_path / "medusa0")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--init" in err and "Traceback" not in err
    assert train("prophet", "prophet0", "--init", str(tmp_path / "eagle0")) == 2
    assert "--init is for --kind medusa or eagle" in capsys.readouterr().err


def test_the_server_serves_eagle_losslessly(tiny_family, tiny_eagle, tmp_path, capsys):
    from serving import ServerProcess

    prompt = "def add(a, b):"
    assert main(["generate", "--model", str(tiny_family["target"]), "--method", "ar", "--prompt", prompt,
                 "--max-new-tokens", "24", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)["text"]
    srv = ServerProcess(["--model", str(tiny_family["target"]), "--method", "eagle", "--heads", str(tiny_eagle),
                         "--max-batch-size", "2", "--served-model-name", "m"], tmp_path / "serve.log")
    try:
        assert srv.health()["method"] == "eagle" and srv.health()["engine"] == "batch"
        for _ in range(2):
            status, reply = srv.post("/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 24,
                                                         "temperature": 0})
            assert status == 200 and reply["choices"][0]["text"] == plain
    finally:
        srv.stop()


def test_the_shipped_drafter_accepts_more_than_medusa_and_stays_lossless():
    """The embedded target's shipped EAGLE drafter loads without --heads, accepts more
    tokens per verify than the shipped Medusa heads drafting as deep, and greedy output is
    plain decoding's, with the drafter's own keys and values held in float16 (a float32
    target on the CPU). The chain's depth is fixed: left to the cost model it follows the
    host's measured costs (a busy CI host once settled on a chain of 1, which cannot beat
    a 4-deep tree)."""
    from quickdraft.generator import SpeculativeGenerator

    eagle = SpeculativeGenerator.from_pretrained(method="eagle", options=DraftOptions(tree="1,1,1,1"))
    medusa = SpeculativeGenerator.from_pretrained(method="medusa", options=DraftOptions(tree="2,2,1,1"))
    plain = SpeculativeGenerator.from_pretrained(method="ar")
    for prompt in ["def median(values):\n", "import os\n\n\ndef walk(root):\n"]:
        got = eagle.generate(prompt, max_new_tokens=48)
        assert got.token_ids == plain.generate(prompt, max_new_tokens=48).token_ids
        assert got.stats.mean_accepted_tokens > medusa.generate(prompt, max_new_tokens=48).stats.mean_accepted_tokens
    assert eagle.drafter.cache.k.dtype == torch.float16 and eagle.drafter.cache.dtype == torch.float32


def test_the_drafter_runs_in_int8_where_our_kernels_run_and_stays_lossless(tiny_family, tiny_eagle, capsys):
    """A float32 EAGLE level reads as much as a target layer or two, so the drafter is
    quantized wherever our kernels run, beside a float32 target as beside a quantized one;
    the output stays plain decoding's."""
    from quickdraft.drafters.eagle import load_eagle_head
    from quickdraft.models.lm import load_model
    from quickdraft.models.placement import resolve_placement
    from quickdraft.models.quant_linear import Int8Linear, native_kernels

    def int8(target) -> bool:
        layers = [m for m in load_eagle_head(target, str(tiny_eagle)).modules() if isinstance(m, Int8Linear)]
        assert all(m.native for m in layers)  # the target's int8 tiles, in our kernels
        return bool(layers)

    assert int8(load_model(tiny_family["target"], placement=resolve_placement(quantize="int8"))) == native_kernels()
    assert int8(load_model(tiny_family["target"])) == native_kernels()
    common = ["generate", "--model", str(tiny_family["target"]), "--max-new-tokens", "40", "--json",
              "--quantize", "int8", "--prompt", "def add(a, b):"]
    assert main([*common, "--method", "ar"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*common, "--method", "eagle", "--heads", str(tiny_eagle), "--tree", "dynamic:6"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain["token_ids"]


def test_a_greedy_chain_proposes_what_the_tree_loop_proposes(monkeypatch):
    """The chain's fast path (causal levels, argmax over the draft vocabulary) computes, bit
    for bit, the drafter outputs the general tree loop computes (the same keys, attended in
    the same order), so it drafts the same tokens and every verify accepts the same."""
    from quickdraft.decoding.engine import decode
    from quickdraft.decoding.stats import GenerationStats
    from quickdraft.decoding.stopping import StopConditions
    from quickdraft.drafters.eagle import load_eagle_head
    from quickdraft.pair import load_pair

    pair = load_pair(None, need_draft=False)
    head = load_eagle_head(pair.target, None)
    prompt = torch.tensor(pair.tokenizer("def median(values):\n")["input_ids"])
    scored = EagleHead.sub_logits
    monkeypatch.setattr(EagleHead, "greedy_chain", lambda *args, **kwargs: None)  # the chain's Python levels
    monkeypatch.setattr(EagleDrafter, "greedy_rounds", lambda *args, **kwargs: None)  # a round at a time
    # The tree loop has no blind first round (a chain's only): both start drafting after the prefill.
    monkeypatch.setattr(EagleDrafter, "_draft_blind", lambda self, sequence, k: EMPTY)
    runs = []
    for fast in (True, False):
        seen: list[torch.Tensor] = []  # every drafter output its LM head scored, in order
        monkeypatch.setattr(EagleHead, "sub_logits", lambda self, h, t, seen=seen: seen.append(h.clone()) or scored(self, h, t))
        monkeypatch.setattr(EagleDrafter, "_greedy_chain", lambda self, fast=fast: fast)
        stats = GenerationStats()
        drafter = EagleDrafter(pair.target, head, StaticTree((1, 1, 1, 1, 1), sample=False))
        steps = list(decode(pair.target, prompt, StopConditions(64), drafter=drafter, num_speculative_tokens=5,
                            stats=stats))
        runs.append(([s.tokens for s in steps], stats.mean_accepted_tokens, seen))
    assert runs[0][:2] == runs[1][:2]
    assert len(runs[0][2]) == len(runs[1][2]) and all(torch.equal(a, b) for a, b in zip(runs[0][2], runs[1][2]))
    assert runs[0][1] > 2  # the chain drafts and is accepted, not a run of empty proposals
    plain = [t for s in decode(pair.target, prompt, StopConditions(64)) for t in s.tokens]
    assert [t for step in runs[0][0] for t in step] == plain


def fused_copy(target, layers: tuple[int, ...], out, start: str = "qd-stdlib-target-eagle") -> str:
    """A shipped drafter reading ``layers`` of ``target`` (its final state among them): its
    map for the final state as it is (at the target's width: the identity), random columns
    for the others (so the fused states change what it drafts), saved to ``out``."""
    from quickdraft.train.heads import widened_map

    start = load_eagle(HEADS_DIR / start, target)
    head = EagleHead(target, start.vocab_ids, start.layer_shape, layers)
    state = {**head.state_dict(), **start.state_dict()}
    torch.manual_seed(0)
    weight = widened_map(start, layers) if start.maps_features else head.feature_in.weight.detach().clone()
    state["feature_in.weight"] = weight + (weight == 0) * torch.randn_like(weight) * weight.std()
    head.load_state_dict(state)
    save_eagle(head, target, "qd-stdlib-target", out)
    return str(out)


@pytest.mark.parametrize("heads", [None, "qd-stdlib-target-eagle-wide", "fused", "wide-fused", "int4"],
                         ids=["shipped-256-wide", "448-wide", "fused-3-layers", "448-wide-fused-3-layers",
                              "int4-beside-int4-target"])
def test_the_chain_in_one_call_drafts_what_its_python_levels_draft(monkeypatch, tmp_path, heads):
    """``qd_eagle_chain`` feeds the accepted tokens and runs the chain's levels in C: the
    same tokens as the Python feed and levels, the same drafter cache bit for bit (both
    scale the feature to unit RMS with ``qd_rms_norm``: with 8-bit activations an ulp there
    had moved the cache by up to 0.01), and greedy output stays plain decoding's; for
    the shipped drafter at the draft model's width (its own embedding and norm), for the
    one of the target's width, and for each fusing three of the target's layers (EAGLE-3);
    and in int4 beside a target in int4."""
    from quickdraft.decoding.engine import decode
    from quickdraft.decoding.stats import GenerationStats
    from quickdraft.decoding.stopping import StopConditions
    from quickdraft.drafters.eagle import load_eagle_head
    from quickdraft.models import cpu_kernels
    from quickdraft.pair import load_pair

    if cpu_kernels.library() is None:
        pytest.skip("needs the compiled CPU kernels")
    from quickdraft.models.placement import resolve_placement
    from quickdraft.models.quant_linear import Int4Linear

    pair = load_pair(None, need_draft=False, placement=resolve_placement(quantize="int4" if heads == "int4" else None))
    wide = "qd-stdlib-target-eagle-wide"
    path = (fused_copy(pair.target.model, (2, 5, 8), tmp_path / "fused") if heads == "fused" else
            fused_copy(pair.target.model, (2, 5, 8), tmp_path / "fused", wide) if heads == "wide-fused" else
            None if heads == "int4" else heads)
    head = load_eagle_head(pair.target, path and str(HEADS_DIR / path))
    assert head.own_width == (heads not in (wide, "wide-fused")) and head.fused == (heads in ("fused", "wide-fused"))
    assert any(isinstance(m, Int4Linear) for m in head.modules()) == (heads == "int4")
    chained = EagleHead.greedy_chain
    runs = []
    for in_c in (True, False):
        ran_in_c = []

        def chain(self, *args, in_c=in_c, ran_in_c=ran_in_c, **kwargs):
            tokens = chained(self, *args, **kwargs) if in_c else None
            ran_in_c.append(tokens is not None)
            return tokens

        monkeypatch.setattr(EagleHead, "greedy_chain", chain)
        out, caches = [], []
        for text in ("def median(values):\n", "import os\n\n\ndef walk(root):\n"):
            prompt = torch.tensor(pair.tokenizer(text)["input_ids"])
            stats = GenerationStats()
            drafter = EagleDrafter(pair.target, head, StaticTree((1,) * 7, sample=False))
            steps = list(decode(pair.target, prompt, StopConditions(64), drafter=drafter, num_speculative_tokens=7,
                                stats=stats))
            out.append(([s.tokens for s in steps], stats.mean_accepted_tokens))
            caches.append(drafter.cache.k[..., : prompt.numel() + 60, :].clone())
            plain = [t for s in decode(pair.target, prompt, StopConditions(64)) for t in s.tokens]
            assert [t for step in out[-1][0] for t in step] == plain
        assert ran_in_c and all(ran_in_c) == in_c
        runs.append((out, caches))
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1], runs[1][1]):
        assert torch.equal(a, b)


def test_the_drafter_reads_a_long_prompts_last_tokens_only(monkeypatch):
    """Past PROMPT_WINDOW prompt tokens the drafter reads only the last ones (its cache
    slots shifted, positions true): greedy output stays plain decoding's, on the tree loop
    and on the chain, and the drafter's cache holds no more than the window and what
    followed."""
    import quickdraft.drafters.eagle as eagle
    from quickdraft.decoding.engine import decode
    from quickdraft.decoding.stopping import StopConditions
    from quickdraft.pair import load_pair

    monkeypatch.setattr(eagle, "PROMPT_WINDOW", 24)
    pair = load_pair(None, need_draft=False)
    head = eagle.load_eagle_head(pair.target, None)
    prompt = torch.tensor(pair.tokenizer("import os\n\n\ndef walk(root):\n    for name in os.listdir(root):\n"
                                         "        path = os.path.join(root, name)\n")["input_ids"])
    assert prompt.numel() > 24
    plain = [t for s in decode(pair.target, prompt, StopConditions(40)) for t in s.tokens]
    leave = EagleDrafter.leave
    for shape in (StaticTree((1,) * 6, sample=False), DynamicTree(8)):
        drafter = EagleDrafter(pair.target, head, shape)
        at_leave = []
        monkeypatch.setattr(EagleDrafter, "leave", lambda self, slot, at_leave=at_leave: at_leave.append((self.offset, self.fed)) or
                            leave(self, slot))
        out = [t for s in decode(pair.target, prompt, StopConditions(40), drafter=drafter, num_speculative_tokens=6)
               for t in s.tokens]
        assert out == plain, shape.name
        (offset, fed), = at_leave
        assert offset == prompt.numel() - 24 and fed > prompt.numel()  # the prompt's window, fed in the prefill
        assert not drafter.cache.k[..., fed - offset + 8 :, :].any()  # no slot past the window and the drafts


def test_a_heuristic_chain_adapts_its_length_and_stays_lossless():
    """``--draft-stop heuristic``: chains of up to 12 (the generator's k), +2 after a fully
    accepted chain, -1 otherwise, each drafted in one call; output is plain decoding's."""
    eagle = SpeculativeGenerator.from_pretrained(method="eagle", options=DraftOptions(draft_stop="heuristic"))
    plain = SpeculativeGenerator.from_pretrained(method="ar")
    assert eagle.resolve_k()[0] == 12 and eagle.drafter.name.endswith("(heuristic)")
    lengths = set()
    for prompt in ("def median(values):\n", "class Stack:\n    def __init__(self"):
        want = plain.generate(prompt, max_new_tokens=64).token_ids
        got = eagle.generate(prompt, max_new_tokens=64)
        assert got.token_ids == want
        drafted = got.stats.drafted_per_position  # chains of length i + 1 end where the count drops
        lengths |= {i + 1 for i in range(len(drafted)) if i + 1 == len(drafted) or drafted[i] > drafted[i + 1]}
    assert len(lengths) > 2 and max(lengths) <= 12  # it moved


@pytest.mark.parametrize("spec", ["confidence:0.6", "dv"])
def test_a_confidence_floor_ends_eagle_chains_in_the_call_as_in_python(monkeypatch, spec):
    """``--draft-stop confidence:T`` and ``dv`` stop on the drafter's top-1 probability:
    ``qd_eagle_chain`` applies the floor inside its call, giving the chains (tokens and
    lengths) the Python levels give, and output stays plain decoding's."""
    from quickdraft.models import cpu_kernels

    if cpu_kernels.library() is None:
        pytest.skip("needs the compiled CPU kernels")
    plain = SpeculativeGenerator.from_pretrained(method="ar")
    chained = EagleHead.greedy_chain
    runs, ended_early = [], []
    for in_c in (True, False):
        def chain(self, tokens, features, n, *args, in_c=in_c, **kwargs):
            out = chained(self, tokens, features, n, *args, **kwargs) if in_c else None
            ended_early.append(out is not None and len(out) < n)
            return out

        monkeypatch.setattr(EagleHead, "greedy_chain", chain)
        eagle = SpeculativeGenerator.from_pretrained(method="eagle", options=DraftOptions(draft_stop=spec))
        out = []
        for prompt in ("def median(values):\n", "class Stack:\n    def __init__(self"):
            got = eagle.generate(prompt, max_new_tokens=64)
            assert got.token_ids == plain.generate(prompt, max_new_tokens=64).token_ids
            out.append((got.token_ids, got.stats.drafted_per_position, got.stats.accepted_per_position))
        runs.append(out)
    assert runs[0] == runs[1] and any(ended_early)


@pytest.mark.parametrize("options, says", [
    (DraftOptions(draft_stop="cost"), "weighs more than the drafter's confidence"),
    (DraftOptions(draft_stop="heuristic", tree="dynamic:8"), "sets a chain's length"),
])
def test_stop_policies_eagle_cannot_follow_are_one_line_errors(options, says):
    with pytest.raises(ValueError, match=says) as info:
        SpeculativeGenerator.from_pretrained(method="eagle", options=options)
    assert "\n" not in str(info.value)
