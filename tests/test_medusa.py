"""Medusa heads: the drafter's token tree is verified losslessly (greedy equality, and
sampled output distributed as the target's, where a wrong rule fails the same test), the
memory-efficient multi-head loss has the naive loss's gradients, and bad input is one line."""

from __future__ import annotations

import json
import weakref

import pytest
import torch
from test_sampling_exact import VOCAB, empirical_pvalue, tiny_lm
from test_trees_exact import MSSWithoutResidualUpdate
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from quickdraft.cli import main
from quickdraft.decoding.sampling import SamplingParams
from quickdraft.drafters import DraftOptions, make_drafter
from quickdraft.drafters.medusa import MedusaDrafter
from quickdraft.models.loading import CheckpointError
from quickdraft.models.medusa import MedusaHeads, load_medusa, save_medusa
from quickdraft.train.card import read_curves
from quickdraft.train.heads import multi_head_backward

TARGET = tiny_lm(0, 3.0)


def random_heads(num_heads: int, hidden: int, seed: int = 0, std: float = 0.5) -> MedusaHeads:
    """Heads that differ from the target's LM head (trained heads start at it)."""
    torch.manual_seed(seed)
    heads = MedusaHeads(num_heads, hidden)
    with torch.no_grad():
        for block in heads.blocks:
            block.proj.weight.normal_(0, std)
    return heads.eval()


@pytest.mark.slow
def test_sampled_medusa_trees_match_the_target_distribution():
    drafter = MedusaDrafter(TARGET, random_heads(2, 16), (2, 2))
    assert empirical_pvalue(TARGET, drafter, SamplingParams(temperature=1.0), n_samples=2000) > 1e-3


@pytest.mark.slow
def test_a_wrong_rule_fails_the_same_medusa_test():
    drafter = MedusaDrafter(TARGET, random_heads(2, 16), (2, 2))
    assert empirical_pvalue(TARGET, drafter, SamplingParams(temperature=1.0), MSSWithoutResidualUpdate,
                            n_samples=500) < 1e-6


def test_efficient_multi_head_backward_has_the_naive_gradients():
    from quickdraft.models.transformer import Transformer

    torch.manual_seed(0)
    target = Transformer(TARGET.model.config)  # plain nn.Linear: the CPU decode kernels have no backward
    trunk = torch.nn.Linear(16, 16)  # a trainable trunk: its gradient must come out right too
    heads = random_heads(3, 16, std=0.3).train()
    x, labels = torch.randn(2, 7, 16), torch.randint(0, VOCAB, (2, 7))

    def losses():
        return [lambda h, i=i: torch.nn.functional.cross_entropy(
            heads.head_logits(i, h, target).flatten(0, 1), labels.flatten()) * 0.8 ** i for i in range(3)]

    sum(loss(trunk(x)) for loss in losses()).backward()
    naive = [p.grad.clone() for p in [*trunk.parameters(), *heads.parameters()]]
    for p in [*trunk.parameters(), *heads.parameters()]:
        p.grad = None
    values = multi_head_backward(trunk(x), losses())
    efficient = [p.grad for p in [*trunk.parameters(), *heads.parameters()]]
    assert len(values) == 3 and all(v > 0 for v in values)
    for a, b in zip(naive, efficient):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of tensor storage alive, and their peak, counted at every op torch runs (backward
    included) and released when a storage is freed: the allocator-independent peak memory of
    what runs inside it (the process's RSS high-water mark is not reported on every machine)."""

    def __init__(self):
        super().__init__()
        self.now = self.peak = 0
        self.seen: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.now -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(storage := t.untyped_storage()) not in self.seen:
                self.seen.add(id(storage))
                self.now += storage.nbytes()
                weakref.finalize(storage, self._freed, id(storage), storage.nbytes())
        self.peak = max(self.peak, self.now)
        return out


@pytest.mark.slow
def test_the_efficient_order_keeps_one_heads_logits_at_a_time():
    """Peak memory of K=4 heads' loss at our vocabulary (8,192), 4 x 512 tokens: each
    head's log-probabilities are 64 MiB; the naive sum keeps all four for its one backward
    (measured: ~460 MiB), the efficient order one head's at a time (~240 MiB: logits,
    log-probabilities and their gradient), saving most of the other three's."""
    from quickdraft.models.config import ModelConfig
    from quickdraft.models.transformer import Transformer

    torch.manual_seed(0)
    # The embedded target's width and vocabulary, one layer.
    target = Transformer(ModelConfig(family="llama", model_type="llama", vocab_size=8192, hidden_size=448, n_layers=1,
                                     n_heads=7, n_kv_heads=7, head_dim=64, intermediate_size=1216,
                                     max_position_embeddings=2048))
    heads = MedusaHeads(4, target.config.hidden_size)
    hidden = torch.randn(4, 512, target.config.hidden_size)
    labels = torch.randint(0, target.config.vocab_size, (4, 512))
    losses = [lambda h, i=i: torch.nn.functional.cross_entropy(heads.head_logits(i, h, target).flatten(0, 1),
                                                               labels.flatten()) for i in range(4)]
    peak = {}
    for mode in ("naive", "efficient"):
        for p in [*heads.parameters(), *target.parameters()]:
            p.grad = None
        with LiveTensorBytes() as live:
            if mode == "naive":
                sum(loss(hidden) for loss in losses).backward()
            else:
                multi_head_backward(hidden, losses)
        peak[mode] = live.peak / 2**20
    print(f"peak tensor memory, MiB: {peak}")
    assert peak["efficient"] < 0.75 * peak["naive"] and peak["naive"] - peak["efficient"] > 2 * 64


@pytest.fixture(scope="module")
def tiny_heads(tiny_family, tmp_path_factory):
    from quickdraft.models.lm import load_model

    target = load_model(tiny_family["target"])
    out = tmp_path_factory.mktemp("medusa")
    save_medusa(random_heads(3, target.config.hidden_size, std=0.05), target.model, "tiny-target", out)
    return out


def test_greedy_medusa_equals_plain_decoding_in_the_cli(tiny_family, tiny_heads, capsys):
    common = ["generate", "--model", str(tiny_family["target"]), "--max-new-tokens", "40", "--json"]
    for prompt in ["def add(a, b):", "for i in range(10):\n    print(i"]:
        assert main([*common, "--prompt", prompt, "--method", "ar"]) == 0
        plain = json.loads(capsys.readouterr().out)
        assert main([*common, "--prompt", prompt, "--method", "medusa", "--heads", str(tiny_heads),
                     "--tree", "3,2,1"]) == 0
        medusa = json.loads(capsys.readouterr().out)
        assert medusa["token_ids"] == plain["token_ids"]
        assert medusa["settings"]["method"] == "medusa"


def test_medusa_without_heads_or_with_another_targets_is_one_line(tiny_family, tiny_heads, capsys):
    common = ["generate", "--model", str(tiny_family["target"]), "--prompt", "x", "--max-new-tokens", "4"]
    assert main([*common, "--method", "medusa"]) != 0
    err = capsys.readouterr().err
    assert "needs Medusa heads" in err and "train heads" in err and "Traceback" not in err
    assert main([*common, "--method", "medusa", "--heads", str(tiny_heads), "--backend", "hf"]) != 0
    assert "native runtime" in capsys.readouterr().err
    from quickdraft.models.lm import load_model

    other = load_model(tiny_family["unrelated"])
    with pytest.raises(CheckpointError, match="another target"):
        load_medusa(tiny_heads, other.model)
    with pytest.raises(ValueError, match="static tree"):
        make_drafter("medusa", None, other.vocab_size, DraftOptions(tree="dynamic:4", heads=str(tiny_heads)),
                     target=other)


def test_train_heads_end_to_end_resume_and_lossless(tmp_path, capsys):
    """`train heads --kind medusa` on a tiny target: files, card, per-head agreement, --resume,
    and the trained heads draft losslessly through the API (and accept some tokens: the data
    repeats, so even a few steps teach the heads something)."""
    from conftest import build_tokenizer, save_llama

    from quickdraft.generator import SpeculativeGenerator

    tok = build_tokenizer(tmp_path / "target")
    save_llama(tmp_path / "target", len(tok), layers=2, hidden=64, seed=0, eos=tok.eos_token_id, scale=20.0)
    (tmp_path / "data").mkdir()
    for i in range(8):
        (tmp_path / "data" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + len(str(x))\n" * 12)
    out = tmp_path / "heads"

    def train(*extra):
        return main(["train", "heads", "--kind", "medusa", "--num-heads", "2", "--target", str(tmp_path / "target"),
                     "--data", str(tmp_path / "data"), "--out", str(out), "--steps", "8", "--seq-len", "32",
                     "--batch-size", "2", "--lr", "1e-2", "--ckpt-every", "4", "--eval-tokens", "256",
                     "--threads", "1", "--no-progress", "--probe-every", "4", *extra])

    assert train() == 0
    assert {"config.json", "model.safetensors", "README.md", "train_log.jsonl", "loss_curve.png",
            "acceptance_curve.png", "train_report.json", "tensorboard"} <= {p.name for p in out.iterdir()}
    report = json.loads((out / "train_report.json").read_text())
    assert len(report["heldout_agreement"]) == 2 and all(0 <= a <= 1 for a in report["heldout_agreement"])
    card = (out / "README.md").read_text()
    assert "Medusa heads" in card and "tensorboard --logdir" in card and "acceptance_curve.png" in card
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert {"head0", "head1"} <= set([r for r in records if r["event"] == "train"][-1])
    assert train("--resume", "--steps", "10") == 0
    steps = [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert steps[-1] == 10 and steps == sorted(steps)
    curves = read_curves(out)  # TensorBoard's reader on the event files
    assert [s for s, _ in curves["train/loss"]] == [8, 10]  # --log-every 10: the last step of each run
    assert [s for s, _ in curves["probe/mean_accepted_tokens"]] == [0, 4, 8, 10]
    assert {"probe/accept_rate/pos1", "probe/accept_rate/pos2", "train/head0"} <= set(curves)
    assert train("--resume", "--num-heads", "3") == 2 and "other settings" in capsys.readouterr().err
    plain = SpeculativeGenerator.from_pretrained(str(tmp_path / "target"), method="ar")
    medusa = SpeculativeGenerator.from_pretrained(str(tmp_path / "target"), method="medusa",
                                                  options=DraftOptions(heads=str(out)))
    prompt = "def f3(x):\n"
    out_medusa = medusa.generate(prompt, max_new_tokens=32)
    assert out_medusa.token_ids == plain.generate(prompt, max_new_tokens=32).token_ids
    assert medusa.drafter.name == "medusa(2,2)"


def test_the_server_serves_medusa_losslessly(tiny_family, tiny_heads, tmp_path, capsys):
    from serving import ServerProcess

    prompt = "def add(a, b):"
    assert main(["generate", "--model", str(tiny_family["target"]), "--method", "ar", "--prompt", prompt,
                 "--max-new-tokens", "24", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)["text"]
    srv = ServerProcess(["--model", str(tiny_family["target"]), "--method", "medusa", "--heads", str(tiny_heads),
                         "--max-batch-size", "2", "--served-model-name", "m"], tmp_path / "serve.log")
    try:
        assert srv.health()["method"] == "medusa" and srv.health()["engine"] == "batch"
        bodies = [{"model": "m", "prompt": prompt, "max_tokens": 24, "temperature": 0}] * 2
        for body in bodies:
            status, reply = srv.post("/v1/completions", body)
            assert status == 200 and reply["choices"][0]["text"] == plain
    finally:
        srv.stop()


def test_the_shipped_heads_accept_tokens_and_stay_lossless():
    """The embedded target's shipped heads load without --heads, accept draft tokens, and
    greedy output is plain decoding's."""
    from quickdraft.generator import SpeculativeGenerator

    medusa = SpeculativeGenerator.from_pretrained(method="medusa", options=DraftOptions(tree="2,2,1,1"))
    plain = SpeculativeGenerator.from_pretrained(method="ar")
    assert medusa.drafter.name == "medusa(2,2,1,1)"
    accepted = []
    for prompt in ["def median(values):\n", "import os\n\n\ndef walk(root):\n"]:
        out = medusa.generate(prompt, max_new_tokens=48)
        assert out.token_ids == plain.generate(prompt, max_new_tokens=48).token_ids
        accepted.append(out.stats.mean_accepted_tokens)
    assert min(accepted) > 1.2, accepted
