"""The prophet transformer: its drafts are what its training computes (a check that catches
each of the source scratchpad's three bugs, injected here), the chain is verified
losslessly (greedy equality; sampled output distributed as the target's, where a wrong
rule fails the same test), training on a frozen target and jointly with one works, and
bad input is one line."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from test_sampling_exact import PROMPT, TARGET, NoResidual, empirical_pvalue
from torch import nn

from quickdraft.cli import main
from quickdraft.decoding.engine import decode
from quickdraft.decoding.sampling import SamplingParams, probabilities
from quickdraft.decoding.stopping import StopConditions
from quickdraft.drafters import DraftOptions
from quickdraft.drafters.prophet import ProphetDrafter
from quickdraft.models.lm import NativeLM, load_model
from quickdraft.models.loading import CheckpointError
from quickdraft.models.prophet import Prophet, ProphetConfig, load_prophet, save_prophet
from quickdraft.train.prophet import prophet_batch

N_START = 2


def random_prophet(hidden: int, vocab: int, width: int = 12, heads: int = 3, seed: int = 0,
                   n_start: int = N_START) -> Prophet:
    """Two layers, a linear start map (another width), weights scaled up for varied drafts."""
    torch.manual_seed(seed)
    prophet = Prophet(ProphetConfig(hidden, vocab, width, n_layers=2, n_heads=heads, n_start=n_start, gamma=3,
                                    project=True, max_positions=16))
    with torch.no_grad():
        for p in prophet.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.4)
    return prophet.eval()


def reference_logits(prophet: Prophet, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The prophet's math written out from its weights, none of the runtime's code: the mapped
    states then the token embeddings at positions 0, 1, ..., each layer attention then
    feed-forward (pre-norm, residual), final norm, tied LM head."""
    dec, cfg = prophet.decoder, prophet.decoder.config
    x = torch.cat([states @ prophet.start.weight.T, dec.embed.weight[tokens]])
    t, nh, hd = x.shape[0], cfg.n_heads, cfg.head_dim
    angles = torch.arange(t)[:, None] / cfg.rope_theta ** (torch.arange(0, hd, 2) / hd)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rope(v):  # [nh, t, hd]
        return v * cos + torch.cat([-v[..., hd // 2 :], v[..., : hd // 2]], -1) * sin

    def norm(v, weight):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * weight

    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for layer in dec.layers:
        q, k, v = (norm(x, layer.attn_norm.weight) @ layer.attn.wqkv.weight.T).view(t, 3, nh, hd).unbind(1)
        scores = rope(q.transpose(0, 1)) @ rope(k.transpose(0, 1)).transpose(1, 2) / math.sqrt(hd)
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v.transpose(0, 1)
        x = x + attn.transpose(0, 1).reshape(t, nh * hd) @ layer.attn.wo.weight.T
        gate, up = (norm(x, layer.mlp_norm.weight) @ layer.mlp.w_in.weight.T).chunk(2, -1)
        x = x + (F.silu(gate) * up) @ layer.mlp.w_out.weight.T
    return norm(x, dec.norm.weight) @ dec.embed.weight.T


# The source's three bugs, each injected into an otherwise correct prophet.
class SkipsFeedForward(nn.Module):
    """Bug 1: a decoder layer whose feed-forward is never applied."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x, rope, cache, layer, rows, slots, mask, kv_len, attn=True, mlp=True, ragged=()):
        return self.block(x, rope, cache, layer, rows, slots, mask, kv_len, attn, False, ragged)


class StaleStarts(ProphetDrafter):
    """Bug 2: the start states are the verify pass's last ones (a rejected draft's whenever
    one was rejected), not those of the last accepted tokens."""

    def __init__(self, target, prophet):
        super().__init__(target, prophet)
        self.target = target

    def observe(self, slot, start, states):
        fed = self.target.hidden_states[self.reads_hidden[0]]
        self._states = (fed if self._states is None else torch.cat([self._states, fed]))[-self.n :]


class PositionsOffByOne(ProphetDrafter):
    """Bug 3: drafted tokens fed one position further than training put them."""

    def _feed(self, tokens, hidden=None):
        positions = torch.arange(tokens.shape[0]) + self.lm.length + (hidden is None)
        return self.lm.extend(tokens, logits="last", hidden=hidden, positions=positions)


def draft_mismatch(variant: str) -> float:
    """Sampled decoding with a prophet drafter; the largest gap between a draft distribution
    it proposed and the reference's, fed a fresh target pass's states of the last
    ``N_START`` accepted tokens, then the newest token and the earlier drafts."""
    prophet = random_prophet(TARGET.config.hidden_size, TARGET.vocab_size)
    reference = copy.deepcopy(prophet)  # the drafter packs the decoder's weights for its kernels
    if variant == "no-feed-forward":
        prophet.decoder.layers = nn.ModuleList(SkipsFeedForward(b) for b in prophet.decoder.layers)
    cls = {"stale-starts": StaleStarts, "positions-off-by-one": PositionsOffByOne}.get(variant, ProphetDrafter)
    drafter = cls(TARGET, prophet)
    rounds = []
    propose = drafter.propose

    def recording(slots, sequences, ks):
        out = propose(slots, sequences, ks)
        rounds.append((sequences[0].clone(), out[0]))
        return out

    drafter.propose = recording
    params = SamplingParams(temperature=1.0, seed=3)
    list(decode(TARGET, PROMPT, StopConditions(30), drafter=drafter, params=params, num_speculative_tokens=3))
    final = TARGET.config.n_layers
    gaps = []
    for sequence, proposal in rounds:
        if proposal.size == 0:
            continue
        fresh = NativeLM(TARGET.model)
        fresh.reset()
        fresh.extend(sequence[:-1], logits="none", output_hidden_states=(final,))
        tokens = torch.cat([sequence[-1:], proposal.tokens[:-1]])
        with torch.no_grad():
            ref = reference_logits(reference, fresh.hidden_states[final][-N_START:], tokens)[N_START:]
        gaps.append((probabilities(ref, params) - proposal.probs).abs().max().item())
    assert len(gaps) > 5
    return max(gaps)


@pytest.mark.parametrize("variant", ["correct", "no-feed-forward", "stale-starts", "positions-off-by-one"])
def test_drafts_equal_the_written_out_prophet_and_each_source_bug_fails(variant):
    gap = draft_mismatch(variant)
    if variant == "correct":
        assert gap < 1e-5, gap
    else:  # the same check must catch each bug
        assert gap > 1e-2, gap


def test_training_sequences_are_what_drafting_feeds():
    """The training sequence that starts after text position s is the one drafting builds when
    the sequence has s + 2 tokens: states of s - n + 1 .. s, then token s + 1 and the next
    ones, each output predicting the token after its own; and the training forward equals
    the written-out prophet."""
    hidden = torch.arange(10.0)[None, :, None].expand(1, 10, 4)  # a state carries its position
    batch = 100 + torch.arange(11)[None]
    states, inputs, positions, rows = prophet_batch(batch, hidden, n=2, gamma=3)
    s = 5  # the sequence for s starts at text position s - n + 1 = 4: window index 4 (starts at n - 1 = 1)
    i = s - 1
    assert states[i, :, 0].tolist() == [4.0, 5.0] and inputs[i].tolist() == [106, 107, 108]
    assert (batch[rows[i], positions[i] + 1]).tolist() == [105, 106, 107, 108, 109]
    assert states.shape[0] == 10 - 3 - 2 + 1  # every start with a full window inside the batch
    prophet, starts = random_prophet(4, 200), torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(prophet(starts[None], inputs[:1] - 100)[0],
                                   reference_logits(prophet, starts, inputs[0] - 100), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_sampled_prophet_drafts_match_the_target_distribution():
    drafter = ProphetDrafter(TARGET, random_prophet(TARGET.config.hidden_size, TARGET.vocab_size, n_start=1))
    assert empirical_pvalue(TARGET, drafter, SamplingParams(temperature=1.0), n_samples=1200) > 1e-3


@pytest.mark.slow
def test_a_wrong_rule_fails_the_same_prophet_test():
    drafter = ProphetDrafter(TARGET, random_prophet(TARGET.config.hidden_size, TARGET.vocab_size, n_start=1))
    assert empirical_pvalue(TARGET, drafter, SamplingParams(temperature=1.0), NoResidual, n_samples=500) < 1e-6


@pytest.fixture(scope="module")
def tiny_prophet(tiny_family, tmp_path_factory):
    target = load_model(tiny_family["target"])
    out = tmp_path_factory.mktemp("prophet")
    save_prophet(random_prophet(target.config.hidden_size, target.vocab_size, width=32, heads=4, n_start=1),
                 target.model, "tiny-target", out)
    return out


def test_greedy_prophet_equals_plain_decoding_in_the_cli(tiny_family, tiny_prophet, capsys):
    common = ["generate", "--model", str(tiny_family["target"]), "--max-new-tokens", "40", "--json"]
    for prompt in ["def add(a, b):", "for i in range(10):\n    print(i", "x"]:
        assert main([*common, "--prompt", prompt, "--method", "ar"]) == 0
        plain = json.loads(capsys.readouterr().out)
        assert main([*common, "--prompt", prompt, "--method", "prophet", "--heads", str(tiny_prophet),
                     "--num-speculative-tokens", "3"]) == 0
        prophet = json.loads(capsys.readouterr().out)
        assert prophet["token_ids"] == plain["token_ids"]
        assert prophet["settings"]["method"] == "prophet"


def test_prophet_without_heads_or_with_another_targets_is_one_line(tiny_family, tiny_prophet, capsys):
    common = ["generate", "--model", str(tiny_family["target"]), "--prompt", "x", "--max-new-tokens", "4"]
    assert main([*common, "--method", "prophet"]) != 0
    err = capsys.readouterr().err
    assert "needs a prophet" in err and "--kind prophet" in err and "Traceback" not in err
    assert main([*common, "--method", "prophet", "--heads", str(tiny_prophet), "--backend", "hf"]) != 0
    assert "native runtime" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="another target"):
        load_prophet(tiny_prophet, load_model(tiny_family["unrelated"]).model)
    with pytest.raises(CheckpointError, match="holds no prophet"):
        load_prophet(tiny_family["target"], load_model(tiny_family["target"]).model)
    with pytest.raises(ValueError, match="linear map"):
        ProphetConfig(64, 300, 32, project=False)


def test_train_prophet_end_to_end_resume_and_lossless(tmp_path, capsys):
    """`train heads --kind prophet` on a tiny target: files, card, per-depth agreement,
    --resume, and the trained prophet drafts losslessly through the API."""
    from conftest import build_tokenizer, save_llama

    from quickdraft.generator import SpeculativeGenerator

    tok = build_tokenizer(tmp_path / "target")
    save_llama(tmp_path / "target", len(tok), layers=2, hidden=64, seed=0, eos=tok.eos_token_id, scale=20.0)
    (tmp_path / "data").mkdir()
    for i in range(8):
        (tmp_path / "data" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + len(str(x))\n" * 12)
    out = tmp_path / "prophet"

    def train(*extra):
        return main(["train", "heads", "--kind", "prophet", "--gamma", "3", "--target", str(tmp_path / "target"),
                     "--data", str(tmp_path / "data"), "--out", str(out), "--steps", "8", "--seq-len", "32",
                     "--batch-size", "2", "--lr", "1e-2", "--ckpt-every", "4", "--eval-tokens", "256",
                     "--threads", "1", "--no-progress", *extra])

    assert train() == 0
    assert {"config.json", "model.safetensors", "README.md", "train_log.jsonl", "loss_curve.png",
            "train_report.json"} <= {p.name for p in out.iterdir()}
    report = json.loads((out / "train_report.json").read_text())
    assert len(report["heldout_agreement"]) == 3 and all(0 <= a <= 1 for a in report["heldout_agreement"])
    assert "prophet transformer" in (out / "README.md").read_text()
    assert train("--resume", "--steps", "10") == 0
    steps = [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert steps[-1] == 10 and steps == sorted(steps)
    assert train("--resume", "--gamma", "4") == 2 and "other settings" in capsys.readouterr().err
    plain = SpeculativeGenerator.from_pretrained(str(tmp_path / "target"), method="ar")
    prophet = SpeculativeGenerator.from_pretrained(str(tmp_path / "target"), method="prophet",
                                                   options=DraftOptions(heads=str(out)))
    prompt = "def f3(x):\n"
    got = prophet.generate(prompt, max_new_tokens=32)
    assert got.token_ids == plain.generate(prompt, max_new_tokens=32).token_ids
    assert prophet.drafter.name == "prophet" and got.stats.drafted_tokens > 0


def test_the_prophet_term_reaches_the_main_model_in_joint_training(tmp_path):
    """Joint mode (the source's experiment): with the prophet term the main model's gradient
    changes (its states are not detached); without it the run is plain training. The curves
    go to TensorBoard event files, which the chart reads back."""
    import numpy as np

    from quickdraft.train.prophet_joint import run
    from quickdraft.train.tracker import Tracker, read_scalars

    stream = np.random.default_rng(0).integers(0, 50, 4000)
    common = dict(steps=3, width=32, layers=2, seq_len=16, batch_size=2, lr=1e-2, seed=0, eval_every=3,
                  eval_tokens=256, log=lambda m: None)
    without = run(stream, stream[:600], 50, with_prophet=False, **common)
    again = run(stream, stream[:600], 50, with_prophet=False, **common)
    with Tracker(tmp_path / "tb") as tracker:
        joint = run(stream, stream[:600], 50, with_prophet=True, tracker=tracker, **common)
    logged = read_scalars(tmp_path / "tb")
    assert [v for _, v in logged["eval/main_ce"]] == pytest.approx(joint["val_loss"])
    assert len(logged["train/prophet_ce"]) == 3
    assert without["val_loss"] == again["val_loss"]  # same data, steps and seed: the same run
    assert without["val_loss"][0] == joint["val_loss"][0]  # the same initial main model
    assert without["val_loss"][-1] != joint["val_loss"][-1] and joint["prophet_loss"]


def test_the_server_serves_prophet_losslessly(tiny_family, tiny_prophet, tmp_path, capsys):
    from serving import ServerProcess

    prompt = "def add(a, b):"
    assert main(["generate", "--model", str(tiny_family["target"]), "--method", "ar", "--prompt", prompt,
                 "--max-new-tokens", "24", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)["text"]
    srv = ServerProcess(["--model", str(tiny_family["target"]), "--method", "prophet", "--heads", str(tiny_prophet),
                         "--max-batch-size", "2", "--served-model-name", "m"], tmp_path / "serve.log")
    try:
        assert srv.health()["method"] == "prophet"
        for _ in range(2):
            status, reply = srv.post("/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 24,
                                                         "temperature": 0})
            assert status == 200 and reply["choices"][0]["text"] == plain
    finally:
        srv.stop()


def test_the_shipped_prophet_accepts_tokens_and_stays_lossless():
    """The embedded target's shipped prophet loads without --heads, accepts draft tokens,
    and greedy output is plain decoding's."""
    from quickdraft.drafters.prophet import shipped_prophet
    from quickdraft.generator import SpeculativeGenerator

    prophet = SpeculativeGenerator.from_pretrained(method="prophet")
    plain = SpeculativeGenerator.from_pretrained(method="ar")
    accepted = []
    for prompt in ["def median(values):\n", "import os\n\n\ndef walk(root):\n"]:
        out = prophet.generate(prompt, max_new_tokens=48)
        assert out.token_ids == plain.generate(prompt, max_new_tokens=48).token_ids
        accepted.append(out.stats.mean_accepted_tokens)
    assert min(accepted) > 1.2, accepted
    # --draft-vocab reaches it: its draft_vocab.json's 512 most frequent tokens, the same output.
    small = SpeculativeGenerator.from_pretrained(method="prophet", draft_vocab=512)
    ranking = json.loads((shipped_prophet(small.target) / "draft_vocab.json").read_text())["ranking"]
    assert small.drafter.prophet.decoder.head_ids.tolist() == ranking[:512]
    prompt = "def median(values):\n"
    assert small.generate(prompt, max_new_tokens=32).token_ids == plain.generate(prompt, max_new_tokens=32).token_ids
