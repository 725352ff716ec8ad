"""Early exit (--method early-exit): lossless at every exit layer and with every head,
the shared KV cache is exactly the target's, bad input is one line, heads train."""

from __future__ import annotations

import json

import pytest
import torch
from test_sampling_exact import VOCAB, NoResidual, empirical_pvalue

from quickdraft import cli
from quickdraft.decoding.engine import decode
from quickdraft.decoding.sampling import SamplingParams
from quickdraft.decoding.stopping import StopConditions
from quickdraft.drafters.early_exit import EarlyExitDrafter
from quickdraft.models.config import ModelConfig
from quickdraft.models.exit_head import ExitHead, load_exit_head, save_exit_head
from quickdraft.models.lm import NativeLM
from quickdraft.models.transformer import Transformer

LAYERS = 4


def native_lm(seed: int = 0, vocab: int = 64, layers: int = LAYERS, sharpness: float = 3.0) -> NativeLM:
    """A tiny random Llama in the native runtime, with distributions sharp enough that
    early exits agree with the target sometimes (partial acceptances)."""
    config = ModelConfig(
        family="llama", model_type="llama", vocab_size=vocab, hidden_size=32, n_layers=layers, n_heads=4,
        n_kv_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=128,
    )
    torch.manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3)
        model.lm_head.weight.mul_(sharpness)
    return NativeLM(model.eval(), decode_linears=False)


def random_head(lm: NativeLM, layer: int, kind: str, seed: int = 1) -> ExitHead:
    """A head of each kind; trained heads get random (non-zero) weights so they differ from
    the shared head and from the target."""
    head = ExitHead(lm.config, layer, trained=kind != "shared", extra_block=kind == "extra-block")
    head.init_from(lm.model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return head.eval()


def generate(lm, drafter, prompt, n=40, k=3, params=SamplingParams()):
    return [t for s in decode(lm, prompt, StopConditions(n), drafter=drafter, params=params,
                              num_speculative_tokens=k) for t in s.tokens]


PROMPTS = [torch.tensor([1, 5, 9, 2]), torch.arange(3, 30)]


@pytest.mark.parametrize("kind", ["shared", "trained", "extra-block"])
@pytest.mark.parametrize("share_kv", [True, False], ids=["shared-kv", "own-kv"])
def test_greedy_equals_plain_decoding_at_every_layer(kind, share_kv):
    lm = native_lm()
    accepted = 0
    for i, prompt in enumerate(PROMPTS):
        plain = generate(lm, None, prompt, n=24)
        for layer in range(1, LAYERS):
            k = 1 + (layer + i) % 3 * 2  # k = 1, 3 and 5 over the cases
            drafter = EarlyExitDrafter(lm, random_head(lm, layer, kind), share_kv=share_kv)
            tokens = []
            for step in decode(lm, prompt, StopConditions(24), drafter=drafter, num_speculative_tokens=k):
                tokens += step.tokens
                accepted += step.drafted
            assert tokens == plain, (layer, k)
    assert accepted > 10  # drafts were accepted: the shared cache was really used


class CountingStop:
    """A draft-stop policy (the --draft-stop interface) that stops after 2 tokens."""

    name = "two"

    def __init__(self):
        self.observed = []

    def max_depth(self, k):
        return k

    def keep_going(self, depth, q):
        assert q.shape == (64,) and abs(float(q.sum()) - 1) < 1e-4
        return depth < 2

    def observe(self, drafted, accepted):
        self.observed.append((drafted, accepted))


def test_draft_stop_policy_is_consulted_and_stays_lossless():
    lm = native_lm()
    stop = CountingStop()
    drafter = EarlyExitDrafter(lm, random_head(lm, 2, "trained"), stop_policy=stop)
    assert generate(lm, drafter, PROMPTS[0], k=4) == generate(lm, None, PROMPTS[0])
    assert stop.observed and all(d <= 2 and a <= d for d, a in stop.observed)


@pytest.mark.parametrize("policy", ["confidence:0.3", "dv", "heuristic"])
def test_every_draft_stop_policy_through_the_factory_is_lossless(policy, tmp_path):
    """--draft-stop reaches early exit through make_drafter (the CLI's path); cost is refused."""
    from quickdraft.drafters import DraftOptions, make_drafter

    lm = native_lm()
    head_dir = tmp_path / "head"
    save_exit_head(random_head(lm, 2, "trained"), lm.model, "tiny", head_dir)
    drafter = make_drafter("early-exit", None, lm.vocab_size,
                           DraftOptions(draft_stop=policy, exit_head=str(head_dir)), target=lm)
    assert drafter.stop_policy.name != "fixed"
    for prompt in PROMPTS:
        assert generate(lm, drafter, prompt, k=6) == generate(lm, None, prompt)
    with pytest.raises(ValueError, match="early exit"):
        make_drafter("early-exit", None, lm.vocab_size, DraftOptions(draft_stop="cost", exit_head=str(head_dir)),
                     target=lm)


@pytest.mark.parametrize("kind", ["shared", "extra-block"])
def test_shared_cache_equals_a_fresh_prefill_after_any_number_of_steps(kind):
    lm = native_lm()
    fresh = native_lm()
    for steps in (1, 3, 7):
        drafter = EarlyExitDrafter(lm, random_head(lm, 2, kind), share_kv=True)
        sequence = PROMPTS[0].tolist()
        for i, step in enumerate(decode(lm, PROMPTS[0], StopConditions(60), drafter=drafter,
                                        num_speculative_tokens=3)):
            sequence += step.tokens
            if i + 1 == steps:
                break
        n = lm.length
        assert n == len(sequence) - 1  # the cache holds all but the last token
        fresh.reset(len(sequence) + 1)
        fresh.extend(torch.tensor(sequence[:n]), logits="none")
        for layer in range(LAYERS):
            torch.testing.assert_close(lm.cache.k[layer, :, :, :n], fresh.cache.k[layer, :, :, :n],
                                       rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lm.cache.v[layer, :, :, :n], fresh.cache.v[layer, :, :, :n],
                                       rtol=1e-5, atol=1e-5)
        nxt = torch.tensor(sequence[n:])
        torch.testing.assert_close(lm.extend(nxt), fresh.extend(nxt), rtol=1e-5, atol=1e-5)


def tiny_vocab_lm() -> NativeLM:
    lm = native_lm(0, vocab=VOCAB, layers=3, sharpness=1.0)
    return lm


class ResumeTooLate(EarlyExitDrafter):
    """WRONG: claims its hidden states are one layer deeper than they are (verification
    then skips a layer of the target for the drafted tokens)."""

    def propose(self, slots, sequences, ks):
        proposals = super().propose(slots, sequences, ks)
        for proposal in proposals:
            proposal.start_layer += 1
        return proposals


@pytest.mark.slow
def test_sampled_early_exit_matches_target_distribution():
    lm = tiny_vocab_lm()
    drafter = EarlyExitDrafter(lm, random_head(lm, 1, "trained"), share_kv=True)
    assert empirical_pvalue(lm, drafter, SamplingParams(temperature=1.0), n_samples=1000) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("wrong", ["rule", "resume"])
def test_wrong_early_exit_fails_the_same_test(wrong):
    lm = tiny_vocab_lm()
    cls = ResumeTooLate if wrong == "resume" else EarlyExitDrafter
    drafter = cls(lm, random_head(lm, 1, "trained"), share_kv=True)
    rule = NoResidual if wrong == "rule" else None
    assert empirical_pvalue(lm, drafter, SamplingParams(temperature=1.0), rule, n_samples=1000) < 1e-6


def test_saved_head_round_trips_and_refuses_another_target(tmp_path):
    lm, other = native_lm(0), native_lm(3)
    head = random_head(lm, 2, "extra-block")
    save_exit_head(head, lm.model, "tiny", tmp_path / "head")
    loaded = load_exit_head(tmp_path / "head", lm.model)
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(a.to(torch.bfloat16).float(), b, msg=name)
    with pytest.raises(ValueError, match="another target"):
        load_exit_head(tmp_path / "head", other.model)
    with pytest.raises(ValueError, match="hidden size"):
        load_exit_head(tmp_path / "head", native_lm(0, vocab=32).model)


def run_cli(capsys, *argv):
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse's own checks (e.g. --exit-layer 0)
        code = exc.code
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize("layer", ["8", "0"])
def test_exit_layer_out_of_range_is_one_line(capsys, layer):
    code, err = run_cli(capsys, "generate", "--method", "early-exit", "--exit-layer", layer,
                        "--prompt", "x", "--max-new-tokens", "2")
    assert code == 2 and len(err.splitlines()) == 1 and "exit-layer" in err


def test_head_for_another_target_is_one_line(capsys, tmp_path):
    lm = native_lm()
    save_exit_head(random_head(lm, 2, "trained"), lm.model, "tiny", tmp_path / "head")
    code, err = run_cli(capsys, "generate", "--method", "early-exit", "--draft", str(tmp_path / "head"),
                        "--prompt", "x", "--max-new-tokens", "2")
    assert code == 2 and len(err.splitlines()) == 1 and "hidden size" in err
    code, err = run_cli(capsys, "generate", "--method", "early-exit", "--draft", str(tmp_path),
                        "--prompt", "x", "--max-new-tokens", "2")
    assert code == 2 and len(err.splitlines()) == 1 and "holds no exit head" in err


@pytest.fixture(scope="module")
def train_setup(tmp_path_factory):
    from conftest import build_tokenizer, save_llama

    root = tmp_path_factory.mktemp("exit_head")
    tok = build_tokenizer(root / "target")
    save_llama(root / "target", len(tok), layers=3, hidden=64, seed=0, eos=tok.eos_token_id, scale=20.0)
    (root / "data").mkdir()
    for i in range(8):
        (root / "data" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + len(str(x))\n" * 12)
    return root


def train_head(root, out, *extra):
    return cli.main(["train", "exit-head", "--target", str(root / "target"), "--exit-layer", "1",
                     "--data", str(root / "data"), "--out", str(out), "--steps", "6", "--seq-len", "32",
                     "--batch-size", "2", "--ckpt-every", "3", "--eval-tokens", "256", "--threads", "1",
                     "--no-progress", *extra])


def test_train_exit_head_end_to_end_resume_and_lossless(train_setup, tmp_path, capsys):
    from quickdraft.generator import SpeculativeGenerator

    out = tmp_path / "head"
    assert train_head(train_setup, out, "--extra-block") == 0
    assert {"config.json", "model.safetensors", "README.md", "train_log.jsonl", "loss_curve.png",
            "train_report.json"} <= {p.name for p in out.iterdir()}
    config = json.loads((out / "config.json").read_text())
    assert config["exit_layer"] == 1 and config["extra_block"] and config["target_fingerprint"]
    report = json.loads((out / "train_report.json").read_text())
    assert 0 <= report["heldout"]["greedy_agreement"] <= 1 and "command" in report
    card = (out / "README.md").read_text()
    assert "exit-head" in card and "shared final norm" in card
    # Resume: the finished run's checkpoint continues to more steps with the same settings.
    assert train_head(train_setup, out, "--extra-block", "--resume", "--steps", "9") == 0
    steps = [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert steps[-1] == 9 and steps == sorted(steps)
    assert train_head(train_setup, out, "--resume", "--steps", "12") == 2  # other settings: refused
    assert "other settings" in capsys.readouterr().err
    # The trained head drafts losslessly through the API.
    plain = SpeculativeGenerator.from_pretrained(str(train_setup / "target"), method="ar")
    ee = SpeculativeGenerator.from_pretrained(str(train_setup / "target"), str(out), method="early-exit")
    prompt = "def f(x):\n"
    assert ee.generate(prompt, max_new_tokens=24).token_ids == plain.generate(prompt, max_new_tokens=24).token_ids
    assert ee.drafter.name == "early-exit(L=1,extra-block)"
    # Its draft vocabulary: the training text's tokens ranked (a vocabulary this small is
    # scored whole by default); --draft-vocab N drafts with the N most frequent.
    ranking = json.loads((out / "draft_vocab.json").read_text())["ranking"]
    assert sorted(ranking) == list(range(ee.target.vocab_size)) and report["draft_vocab"]["size"] == 0
    assert ee.drafter.step_head.vocab_head is None
    ee8 = SpeculativeGenerator.from_pretrained(str(train_setup / "target"), str(out), method="early-exit",
                                               draft_vocab=8)
    assert ee8.drafter.step_head.draft_ids.tolist() == ranking[:8]
    assert ee8.generate(prompt, max_new_tokens=24).token_ids == plain.generate(prompt, max_new_tokens=24).token_ids


def test_train_exit_head_bad_layer_is_one_line(train_setup, tmp_path, capsys):
    code = cli.main(["train", "exit-head", "--target", str(train_setup / "target"), "--exit-layer", "3",
                     "--data", str(train_setup / "data"), "--out", str(tmp_path / "h")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--exit-layer must be in 1..2" in err


def test_train_exit_head_bad_device_is_one_line(train_setup, tmp_path, capsys):
    code = train_head(train_setup, tmp_path / "h", "--device", "warp-drive")
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--device 'warp-drive' is not a torch device" in err


def test_head_steps_run_on_decode_kernels_and_stay_lossless():
    """On a target with decode linears the drafter runs a decode-kernel copy of the head
    (the extra block's one-row products were 1.6x a target layer without); the head
    passed in stays a plain module, and greedy output still equals plain decoding."""
    from quickdraft.models.decode_linear import DecodeLinear, onednn_linear_available

    if not onednn_linear_available():
        pytest.fail("this torch build has no oneDNN linear; the CPU decode path is untested")
    plain_lm = native_lm()
    head = random_head(plain_lm, 2, "extra-block")  # from the target's plain weights
    lm = NativeLM(plain_lm.model, decode_linears=True)
    drafter = EarlyExitDrafter(lm, head)
    assert any(isinstance(m, DecodeLinear) for m in drafter.step_head.modules())
    assert not any(isinstance(m, DecodeLinear) for m in head.modules())
    for prompt in PROMPTS:
        assert generate(lm, drafter, prompt, n=24, k=4) == generate(lm, None, prompt, n=24)


def test_the_default_shipped_head_is_the_one_marked_default():
    from quickdraft.drafters.early_exit import resolve_exit_head, shipped_heads
    from quickdraft.models.exit_head import read_head_config
    from quickdraft.models.lm import load_model

    target = load_model("qd-stdlib-target", backend="native")
    heads = shipped_heads(target)
    marked = [path for path in heads if read_head_config(path).default]
    assert len(marked) == 1 and heads[0] == marked[0]
    assert resolve_exit_head(target, None, None).exit_layer == read_head_config(marked[0]).exit_layer


@pytest.mark.parametrize("k", [1, 3])
def test_extra_block_cache_holds_every_accepted_token_after_any_number_of_steps(k):
    """With sharing the extra block reads the last drafted token's state one step late
    (with the next step's first pass); its cache must still equal the block run over the
    whole accepted sequence, or drafts silently get worse (output would stay lossless)."""
    lm = native_lm()
    head = random_head(lm, 2, "extra-block")
    for steps in (1, 4, 9):
        drafter = EarlyExitDrafter(lm, head, share_kv=True)
        sequence = PROMPTS[1].tolist()
        accepted = 0
        for i, step in enumerate(decode(lm, PROMPTS[1], StopConditions(80), drafter=drafter,
                                        num_speculative_tokens=k)):
            sequence += step.tokens
            accepted += step.drafted
            if i + 1 == steps:
                break
        n = drafter.head_len
        assert n >= len(sequence) - 2  # at most the bonus token and one pending state behind
        with torch.inference_mode():
            fresh = lm.model.new_cache(1, len(sequence))
            hidden = lm.model(torch.tensor([sequence]), 0, fresh, layers=(0, 2), logits="none").hidden
            block_cache = head.new_cache(1, len(sequence), hidden)
            head.transform(hidden, lm.model, 0, block_cache)
        for name in ("k", "v"):
            torch.testing.assert_close(getattr(drafter.head_cache, name)[0, :, :, :n],
                                       getattr(block_cache, name)[0, :, :, :n], rtol=1e-5, atol=1e-5)
    assert accepted > 0


def restricted_vocab_lm(quantized: bool) -> NativeLM:
    """native_lm, 32 wide for int8 groups; ``quantized``: its LM head in int8 (as SmolLM2's
    Q8_0 head is), so the restricted rows are a drafter's int8 layer."""
    from quickdraft.models.quant_linear import native_kernels, quantize_head

    lm = native_lm()
    if quantized:
        if not native_kernels():
            pytest.skip("an int8 head needs our kernels (quantize_head keeps float32 without them)")
        assert quantize_head(lm.model)
        lm = NativeLM(lm.model, decode_linears=False)
    return lm


@pytest.mark.parametrize("quantized", [False, True], ids=["float-head", "int8-head"])
def test_a_restricted_vocabulary_drafts_only_its_tokens_and_stays_lossless(quantized):
    """--draft-vocab on an exit head: the drafting copy scores only ``draft_ids`` (the
    target's LM head rows for them; -inf elsewhere), the head passed in keeps the whole
    vocabulary, and greedy output is plain decoding's."""
    from quickdraft.models.quant_linear import Int8Linear, native_kernels

    lm = restricted_vocab_lm(quantized)
    head = random_head(lm, 2, "extra-block")
    full = EarlyExitDrafter(lm, head)
    ids = torch.tensor([7, 3, 60, 12, 0, 41, 33, 18, 25, 50, 9, 5])
    head.draft_ids = ids
    drafter = EarlyExitDrafter(lm, head)
    assert head.vocab_head is None and drafter.step_head.vocab_head is not None
    if quantized and native_kernels():
        assert isinstance(drafter.step_head.vocab_head, Int8Linear)
    x = torch.randn(3, lm.config.hidden_size)
    with torch.no_grad():
        got, ref = drafter.step_head.logits(x, lm.model), full.step_head.logits(x, lm.model)
    others = torch.ones(lm.config.vocab_size, dtype=torch.bool)
    others[ids] = False
    assert torch.isneginf(got[:, others]).all() and torch.isfinite(got[:, ids]).all()
    if not quantized:  # the same rows, the same products
        torch.testing.assert_close(got[:, ids], ref[:, ids], rtol=1e-5, atol=1e-5)
    for prompt in PROMPTS:
        assert generate(lm, drafter, prompt, n=24, k=3) == generate(lm, None, prompt, n=24)


@pytest.mark.slow
def test_sampled_early_exit_over_a_restricted_vocabulary_matches_target_distribution():
    """Proposals that give most tokens probability zero: the exact rule still yields the
    target's distribution (a wrong rule fails this harness: test_wrong_early_exit_...)."""
    lm = tiny_vocab_lm()
    head = random_head(lm, 1, "trained")
    head.draft_ids = torch.tensor([1, 3])
    drafter = EarlyExitDrafter(lm, head, share_kv=True)
    assert empirical_pvalue(lm, drafter, SamplingParams(temperature=1.0), n_samples=1000) > 1e-3


def test_draft_vocab_needs_a_trained_head_with_a_ranking_one_line(capsys, tmp_path):
    lm = native_lm()
    code, err = run_cli(capsys, "generate", "--method", "early-exit", "--draft", "shared", "--exit-layer", "2",
                        "--draft-vocab", "100", "--prompt", "x", "--max-new-tokens", "2")
    assert code == 2 and len(err.splitlines()) == 1 and "needs a trained exit head" in err
    save_exit_head(random_head(lm, 2, "trained"), lm.model, "tiny", tmp_path / "head")
    with pytest.raises(ValueError, match="no draft_vocab.json"):
        load_exit_head(tmp_path / "head", lm.model, 10)
    assert load_exit_head(tmp_path / "head", lm.model).draft_ids is None  # no file: the whole vocabulary


def test_early_exits_k_is_the_cost_models_measured_once_and_cached(monkeypatch, tmp_path):
    """generate's k for early exit (none given) is the cost model's for the target, its
    exit head and the machine: measured on first use, read from the cache after, measured
    again with remeasure; another draft vocabulary is another entry."""
    import quickdraft.policy.exit_layer as exit_layer
    from quickdraft.generator import SpeculativeGenerator

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measured = []
    real = exit_layer.measure_exit_layer
    monkeypatch.setattr(exit_layer, "measure_exit_layer", lambda *a, **kw: measured.append(kw) or real(*a, **kw))
    gen = SpeculativeGenerator.from_pretrained(method="early-exit")
    k, source = gen.resolve_k()
    assert source in ("cost model, measured now", "cost model: early exit is predicted slower, plain decoding")
    assert 0 <= k <= exit_layer.EXIT_MAX_K and len(measured) == 1 and measured[0]["max_k"] == exit_layer.EXIT_MAX_K
    again = SpeculativeGenerator.from_pretrained(method="early-exit")
    assert again.resolve_k() == (k, "cost model, cached" if k else source) and len(measured) == 1
    assert again.resolve_k(remeasure=True)[0] >= 0 and len(measured) == 2
    SpeculativeGenerator.from_pretrained(method="early-exit", draft_vocab=0).resolve_k()
    assert len(measured) == 3  # the whole vocabulary: another head to measure
    assert again.resolve_k(3) == (3, "given") and len(measured) == 3


def test_a_head_only_onednn_holds_leaves_the_draft_vocabulary_whole(monkeypatch):
    """Without our kernels (no C compiler) a large LM head lives only in oneDNN's packed
    form: no rows to copy, so the drafting copy scores the whole vocabulary (slower, the
    same output) instead of failing."""
    import quickdraft.models.decode_linear as decode_linear
    from quickdraft.models import cpu_kernels

    if not decode_linear.onednn_linear_available():
        pytest.skip("this torch build has no oneDNN linear")
    lm = native_lm()
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    monkeypatch.setattr(decode_linear, "SMALL_WEIGHT_ELEMENTS", 0)
    lm.model.lm_head = decode_linear.DecodeLinear(lm.model.lm_head)
    with pytest.raises(decode_linear.PackedWeightsError):
        lm.model.lm_head.dequantized()
    head = random_head(lm, 2, "trained")
    head.draft_ids = torch.tensor([3, 9, 20])
    drafter = EarlyExitDrafter(lm, head)
    assert drafter.step_head.vocab_head is None and drafter.step_head.draft_ids is None
    for prompt in PROMPTS:
        assert generate(lm, drafter, prompt, n=16, k=3) == generate(lm, None, prompt, n=16)
