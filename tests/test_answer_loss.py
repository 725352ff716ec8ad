"""``train heads --loss-on answers``: EAGLE and Medusa train on what the target wrote, not on
the prompts of its self-distilled documents (which a drafter never drafts), and their
held-out agreement counts the same places."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from quickdraft.cli import main
from quickdraft.models.config import ModelConfig
from quickdraft.models.eagle import EagleHead
from quickdraft.models.medusa import MedusaHeads
from quickdraft.models.transformer import Transformer
from quickdraft.train import shards
from quickdraft.train.data import Windows, answer_runs, sample_batch
from quickdraft.train.distill import tokenize
from quickdraft.train.eagle import eagle_agreement, eagle_loss
from quickdraft.train.heads import TargetStates, head_agreement, head_loss
from quickdraft.train.textdata import read_text_data

PROMPT, ANSWER = 5, 7  # a document: its prompt's tokens, then the target's answer


def write_shards(root, documents: int = 40, seed: int = 0) -> None:
    root.mkdir()
    (root / shards.META_FILE).write_text(json.dumps({"format": shards.FORMAT}))
    rng = np.random.default_rng(seed)
    docs = [(rng.integers(1, 250, size=PROMPT + ANSWER).tolist(), {"prompt_tokens": PROMPT})
            for _ in range(documents)]
    shards.write_shard(root, 0, docs, vocab_size=300)


def tiny_target(vocab: int = 50) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(family="llama", model_type="llama", vocab_size=vocab, hidden_size=32, n_layers=2, n_heads=4,
                      n_kv_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=64)
    return Transformer(cfg).eval()


def test_answer_flags_mark_what_the_target_wrote(tmp_path):
    """Text a user gave counts whole; a shard document's separator and prompt do not, its
    answer does; the flags line up with the token stream."""
    from conftest import build_tokenizer

    tok = build_tokenizer(tmp_path / "tok")
    write_shards(tmp_path / "shards")
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.py").write_text("def f(x):\n    return x + 1\n" * 4)
    tokens = tokenize(read_text_data([str(tmp_path / "text"), str(tmp_path / "shards")]), tok, 8)
    flags, stream = tokens.train_answers, tokens.train
    assert flags is not None and flags.shape == stream.shape and flags.dtype == bool
    separators = np.flatnonzero(stream == tok.eos_token_id)  # the text's, then one per document
    text, size = int(separators[1]), 1 + PROMPT + ANSWER
    assert flags[:text].all() and (stream.size - text) % size == 0
    assert separators[1:].tolist() == list(range(text, stream.size, size))
    for at in separators[1:]:
        assert flags[at : at + size].tolist() == [False] * (1 + PROMPT) + [True] * ANSWER
    # A draft vocabulary ranks the tokens a drafter drafts: the answers.
    assert tokens.drafted(True).tolist() == stream[flags].tolist() and tokens.drafted(False) is stream
    # Plain text alone: every token counts, and nothing is masked (the loss as before).
    assert tokenize(read_text_data([str(tmp_path / "text")]), tok, 8).train_answers is None


def test_answer_runs_count_the_answer_tokens_ending_at_each_place():
    flags = torch.tensor([[True, False, True, True, True, False, True], [False] * 3 + [True] * 4])
    expect = []
    for row in flags.tolist():
        run, runs = 0, []
        for flag in row:
            run = run + 1 if flag else 0
            runs.append(run)
        expect.append(runs)
    assert answer_runs(flags).tolist() == expect


def test_windows_with_flags_are_the_same_windows():
    stream = np.arange(100, dtype=np.uint16)
    flags = stream % 3 == 0
    plain = sample_batch(stream, 4, 9, seed=1, step=5)
    both = sample_batch(stream, 4, 9, seed=1, step=5, answers=flags)
    assert isinstance(both, Windows) and torch.equal(both.tokens, plain)
    assert torch.equal(both.answers, torch.from_numpy(flags)[plain])


def window_flags(length: int, first_answer: int) -> torch.Tensor:
    """One window's flags: a prompt up to ``first_answer``, then answer tokens."""
    return (torch.arange(length + 1) >= first_answer)[None]


def moved_by(losses, t_logits: torch.Tensor, place: int) -> set[int]:
    """Which of ``losses(t_logits)`` change when the target's distribution at ``place`` does."""
    changed = t_logits.clone()
    changed[0, place] = torch.randn(t_logits.shape[-1]) * 3
    return {i for i, (x, y) in enumerate(zip(losses(changed), losses(t_logits))) if x != y}


def test_eagle_loss_counts_a_step_where_its_drafts_are_answers():
    """Step k at place p predicts token p + 1 after drafting tokens p - k + 1 .. p: it
    counts where all of them are answers (as when decoding), so a change of the target's
    distribution at place a - 1 (a: the first answer token) moves step 0's loss alone, at
    place a steps 0 and 1, at a + 1 all three; at a prompt place none."""
    target = tiny_target()
    head = EagleHead(target, torch.arange(0, 50, 2))
    length, a, steps = 12, 5, 3
    tokens = torch.randint(0, 50, (1, length))
    features = torch.randn(1, length, 32)
    t_logits = torch.randn(1, length, 50)
    runs = answer_runs(window_flags(length, a))

    def ces(logits):
        with torch.no_grad():
            logs = eagle_loss(head, target, tokens, logits, features, steps, 0.5, 1.0, runs=runs)[1]
        return [logs[f"ce{k}"] for k in range(steps)]

    for place, moved in ((a - 3, set()), (a - 1, {0}), (a, {0, 1}), (a + 1, {0, 1, 2})):
        assert moved_by(ces, t_logits, place) == moved, place
    # Every place an answer: the loss of every place, as without flags.
    every = answer_runs(torch.ones(1, length + 1, dtype=torch.bool))
    with torch.no_grad():
        got = eagle_loss(head, target, tokens, t_logits, features, steps, 0.5, 1.0, runs=every)[0]
        want = eagle_loss(head, target, tokens, t_logits, features, steps, 0.5, 1.0)[0]
    torch.testing.assert_close(got, want)


def test_medusa_loss_counts_a_head_where_its_drafts_are_answers():
    """Head i at place t predicts token t + i + 2 after the target's t + 1 and the heads'
    t + 2 .. t + i + 1: it counts where all of them are answers; the target's distribution
    at place q is head i's at t = q - i - 1."""
    target = tiny_target()
    heads = MedusaHeads(3, 32)
    length, a = 12, 5
    labels = torch.randint(0, 50, (1, length))
    hidden = torch.randn(1, length, 32)
    t_logits = torch.randn(1, length, 50)
    runs = answer_runs(window_flags(length, a))

    def losses(logits):
        with torch.no_grad():
            return [head_loss(heads, target, i, logits, labels, 1.0, 0.2, runs)(hidden).item() for i in range(3)]

    for place, moved in ((a - 1, set()), (a, {0}), (a + 1, {0, 1}), (a + 2, {0, 1, 2})):
        assert moved_by(losses, t_logits, place) == moved, place


def test_prophet_outputs_count_where_their_token_and_the_drafts_before_it_are_answers():
    """Output j of a prophet sequence predicts the token after ``positions[j]``: a draft at
    depth d = j - n + 1 counts where that token and the d - 1 drafted before it are answers,
    an output at the states where its token is one (checked against the definition)."""
    from quickdraft.train.prophet import counted, prophet_batch

    length, a, n, gamma = 14, 6, 2, 3
    flags = window_flags(length, a)
    windows = torch.randint(0, 50, (1, length + 1))
    _, _, positions, rows = prophet_batch(windows, torch.zeros(1, length, 4), n, gamma)
    got = counted(answer_runs(flags), rows, positions, n)
    for seq in range(positions.shape[0]):
        for j in range(n + gamma):
            need = max(j - n + 1, 1)
            token = int(positions[seq, j]) + 1
            assert bool(got[seq, j]) == bool(flags[0, token - need + 1 : token + 1].all()), (seq, j)
    assert got.any() and not got.all()


def test_prophet_loss_and_agreement_count_answers_alone():
    """The target's distribution at a place whose next token is a prompt token moves no
    counted output; at the first answer it does; every token an answer is the loss and
    agreement without flags, none an agreement of 0."""
    from quickdraft.models.prophet import Prophet, ProphetConfig
    from quickdraft.train.data import Windows
    from quickdraft.train.prophet import depth_agreement, make_prophet_loss

    torch.manual_seed(0)
    prophet = Prophet(ProphetConfig(32, 50, 32, n_heads=4, n_start=2, gamma=3))
    length, a = 14, 6
    windows = torch.randint(0, 50, (1, length + 1))
    hidden, t_logits = torch.randn(1, length, 32), torch.randn(1, length, 50)

    def loss(logits, flags):
        batch = windows if flags is None else Windows(windows, flags)
        return make_prophet_loss(lambda _: (logits, hidden), 1.0, 0.1)(prophet, batch)[0].item()

    flags = window_flags(length, a)
    assert moved_by(lambda lg: [loss(lg, flags)], t_logits, a - 2) == set()
    assert moved_by(lambda lg: [loss(lg, flags)], t_logits, a - 1) == {0}
    every = torch.ones(1, length + 1, dtype=torch.bool)
    assert loss(t_logits, every) == pytest.approx(loss(t_logits, None))
    # A second window of prompts alone: the mean over the first window's places, as without it.
    pair = Windows(torch.cat([windows, torch.randint(0, 50, (1, length + 1))]),
                   torch.cat([every, torch.zeros_like(every)]))
    two = make_prophet_loss(lambda _: (t_logits.repeat(2, 1, 1), hidden.repeat(2, 1, 1)), 1.0, 0.1)(prophet, pair)
    assert two[0].item() == pytest.approx(loss(t_logits, None))
    states = TargetStates(tiny_target())
    stream = np.random.default_rng(0).integers(0, 50, size=200).astype(np.uint16)
    plain = depth_agreement(prophet, states, stream, 16, 160)
    assert depth_agreement(prophet, states, stream, 16, 160, np.ones(200, dtype=bool)) == pytest.approx(plain)
    assert depth_agreement(prophet, states, stream, 16, 160, np.zeros(200, dtype=bool)) == [0.0] * 3
    # Zero final norms make every logit 0, so both pick token 0: agreement 1 where counted.
    # Answers up to token 80 (the first five windows of ten): 1, not 1/2.
    with torch.no_grad():
        states.target.norm.weight.zero_()
        prophet.decoder.norm.weight.zero_()
    first = np.arange(200) <= 80
    assert depth_agreement(prophet, states, stream, 16, 160, first) == [1.0] * 3


def test_held_out_agreement_counts_the_places_the_loss_counts():
    """No answer in the held-out text: nothing to count; every token an answer: what the
    unmasked agreement counts (windows inside the stream); a prompt in each window: its
    own figure."""
    target = tiny_target()
    head = EagleHead(target, None)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    states = TargetStates(target)
    stream = np.random.default_rng(0).integers(0, 50, size=200).astype(np.uint16)
    every, none = np.ones(200, dtype=bool), np.zeros(200, dtype=bool)
    plain = eagle_agreement(head, states, stream, 16, 160, 3)
    assert eagle_agreement(head, states, stream, 16, 160, 3, every) == pytest.approx(plain)
    assert eagle_agreement(head, states, stream, 16, 160, 3, none) == [0.0] * 3
    heads = MedusaHeads(2, 32)
    plain = head_agreement(heads, states, stream, 16, 160)
    assert head_agreement(heads, states, stream, 16, 160, every) == pytest.approx(plain)
    assert head_agreement(heads, states, stream, 16, 160, none) == [0.0] * 2


def test_train_heads_on_shards_trains_on_answers_by_default(tmp_path):
    from conftest import build_tokenizer, save_llama

    tok = build_tokenizer(tmp_path / "target")
    save_llama(tmp_path / "target", len(tok), layers=2, hidden=64, seed=0, eos=tok.eos_token_id)
    write_shards(tmp_path / "shards", documents=80)

    def train(kind, *extra):
        out = tmp_path / f"{kind}{len(extra)}"
        code = main(["train", "heads", "--kind", kind, "--target", str(tmp_path / "target"), "--data",
                     str(tmp_path / "shards"), "--out", str(out), "--steps", "2", "--seq-len", "24", "--batch-size",
                     "2", "--eval-tokens", "96", "--threads", "1", "--no-progress", *extra])
        return code, out

    for kind in ("eagle", "medusa", "prophet"):
        code, out = train(kind)
        assert code == 0
        assert json.loads((out / "train_report.json").read_text())["loss_on"] == "answers"
        assert "--loss-on answers" in (out / "README.md").read_text()
        code, every = train(kind, "--loss-on", "all")
        assert code == 0 and json.loads((every / "train_report.json").read_text())["loss_on"] == "all"
        assert "--loss-on answers" not in (every / "README.md").read_text()
        # The same windows and seed: only the places the loss counted tell the two runs apart.
        assert (out / "model.safetensors").read_bytes() != (every / "model.safetensors").read_bytes()


def tiny_hf_draft():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("rows", [None, torch.arange(0, 50, 2)], ids=["whole-vocabulary", "draft-vocabulary"])
def test_a_drafts_hard_label_loss_counts_answer_tokens_alone(rows):
    """``train draft --kl-weight 0``: the cross-entropy of the next tokens that are answers
    (and in the draft vocabulary), as if the others were not there."""
    from quickdraft.train.trainer import make_label_loss

    model, loss_fn = tiny_hf_draft(), make_label_loss(rows)
    windows = torch.randint(0, 50, (2, 13))
    flags = window_flags(12, 5).expand(2, -1).clone()
    with torch.no_grad():
        assert loss_fn(model, Windows(windows, torch.ones_like(flags)))[0] == loss_fn(model, windows)[0]
        got = loss_fn(model, Windows(windows, flags))[0]
        logits = model(input_ids=windows[:, :-1]).logits
        keep = torch.ones(50, dtype=torch.bool) if rows is None else torch.isin(torch.arange(50), rows)
        if rows is not None:
            logits = logits[..., rows]
        labels = windows[:, 1:] if rows is None else torch.bucketize(windows[:, 1:], rows)
        use = flags[:, 1:] & keep[windows[:, 1:]]
        want = torch.nn.functional.cross_entropy(logits[use], labels[use])
    torch.testing.assert_close(got, want)
    with torch.no_grad():  # a window of prompts alone: nothing to learn, and no NaN in the weights
        assert loss_fn(model, Windows(windows, torch.zeros_like(flags)))[0] == 0


def test_a_drafts_distillation_counts_the_places_before_answers():
    from quickdraft.train.trainer import distill_objective

    t_logits, logits = torch.randn(1, 12, 50), torch.randn(1, 12, 50)
    labels = torch.randint(0, 50, (1, 12))
    mask = window_flags(12, 5)[:, 1:]  # place p counts where token p + 1 is an answer: p >= 4
    base = distill_objective(t_logits, logits, labels, 1.0, 0.1, mask)[0]
    for place, moves in ((3, False), (4, True)):
        changed = t_logits.clone()
        changed[0, place] = torch.randn(50) * 3
        assert (distill_objective(changed, logits, labels, 1.0, 0.1, mask)[0] != base) == moves
    every = torch.ones(1, 12, dtype=torch.bool)
    torch.testing.assert_close(distill_objective(t_logits, logits, labels, 1.0, 0.1, every)[0],
                               distill_objective(t_logits, logits, labels, 1.0, 0.1)[0])


@pytest.mark.parametrize("command, extra", [("draft", ["--config", "tiny", "--kl-weight", "0"]),
                                            ("exit-head", ["--exit-layer", "1"])])
def test_train_draft_and_exit_head_on_shards_train_on_answers_by_default(tmp_path, command, extra):
    from conftest import build_tokenizer, save_llama

    tok = build_tokenizer(tmp_path / "target")
    save_llama(tmp_path / "target", len(tok), layers=2, hidden=64, seed=0, eos=tok.eos_token_id)
    write_shards(tmp_path / "shards", documents=80)
    weights = {}
    for loss_on in ("answers", "all"):
        out = tmp_path / loss_on
        assert main(["train", command, "--target", str(tmp_path / "target"), "--data", str(tmp_path / "shards"),
                     "--out", str(out), *extra, "--steps", "2", "--seq-len", "24", "--batch-size", "2",
                     "--eval-tokens", "64", "--probe-every", "0", "--threads", "1", "--no-progress",
                     *(["--loss-on", "all"] if loss_on == "all" else [])]) == 0
        assert json.loads((out / "train_report.json").read_text())["loss_on"] == loss_on
        assert ("--loss-on answers" in (out / "README.md").read_text()) == (loss_on == "answers")
        weights[loss_on] = (out / "model.safetensors").read_bytes()
    assert weights["answers"] != weights["all"]
