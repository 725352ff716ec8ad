"""``train heads`` / ``train exit-head --teacher``: on a CPU with quickdraft's kernels, a
GGUF target's passes teach on the file's own quantized weights, the model generation runs
(the logits verification accepts, the states a head drafts from); float32 otherwise."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf_files import write_tiny_gguf

from quickdraft.cli import main
from quickdraft.models.lm import load_model
from quickdraft.models.quant_linear import WeightOnlyLinear, fast_kernels
from quickdraft.train import shards
from quickdraft.train.exit_head import TargetPass, load_native_teacher, load_teacher_passes
from quickdraft.train.heads import TargetStates

pytestmark = pytest.mark.skipif(not fast_kernels(), reason="generation runs float32 weights without our kernels")
WINDOWS = torch.tensor([[5, 17, 200, 3, 99, 42, 7, 260, 1, 64, 40, 41], [40, 41, 42, 40, 41, 42, 40, 9, 8, 7, 6, 5]])


@pytest.fixture(scope="module")
def q4_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("teacher") / "target.gguf"
    write_tiny_gguf(path, "Q4_1", seed=0)
    return path


def test_auto_teaches_with_the_model_generation_runs(q4_target):
    target, target_dir, _ = load_native_teacher(str(q4_target))
    passes, teacher = load_teacher_passes(target, target_dir, "auto")
    assert teacher == "quantized" and any(isinstance(m, WeightOnlyLinear) for m in passes.modules())
    generation = load_model(q4_target).model  # generate's default placement: --quantize auto
    positions = torch.arange(WINDOWS.shape[1])[None].expand(2, -1)
    with torch.no_grad():
        expected = generation(WINDOWS, positions, generation.new_cache(2, WINDOWS.shape[1]), output_hidden_states=[1])
    logits, features = TargetStates(target, (1, 2), passes)(WINDOWS)
    torch.testing.assert_close(logits, expected.logits, rtol=0, atol=0)
    torch.testing.assert_close(features[..., :256], expected.hidden_states[1], rtol=0, atol=0)
    exit_logits, hidden, _ = TargetPass(target, 1, passes)(WINDOWS)
    torch.testing.assert_close(exit_logits, expected.logits, rtol=0, atol=0)
    torch.testing.assert_close(hidden, expected.hidden_states[1], rtol=0, atol=0)
    # A float32 pass is another teacher: what the runs before this option learned from.
    assert not torch.equal(TargetStates(target, (1, 2))(WINDOWS)[0], logits)


def test_float32_and_checkpoint_directories_teach_in_float32(q4_target, tmp_path):
    from conftest import build_tokenizer, save_llama

    target, target_dir, _ = load_native_teacher(str(q4_target))
    assert load_teacher_passes(target, target_dir, "float32") == (target, "float32")
    tok = build_tokenizer(tmp_path / "hf")
    save_llama(tmp_path / "hf", len(tok), layers=2, hidden=64, seed=0, eos=tok.eos_token_id)
    target, target_dir, _ = load_native_teacher(str(tmp_path / "hf"))
    assert load_teacher_passes(target, target_dir, "auto") == (target, "float32")  # generation runs it so


def write_shards(root, vocab: int) -> None:
    root.mkdir()
    (root / shards.META_FILE).write_text(json.dumps({"format": shards.FORMAT}))
    rng = np.random.default_rng(0)
    docs = [(rng.integers(1, vocab, size=12).tolist(), {"prompt_tokens": 4}) for _ in range(60)]
    shards.write_shard(root, 0, docs, vocab_size=vocab)


@pytest.mark.parametrize("command", [["heads", "--kind", "eagle", "--feature-layers", "1,2"],
                                     ["heads", "--kind", "medusa"], ["heads", "--kind", "prophet", "--gamma", "2"],
                                     ["exit-head", "--exit-layer", "1"]],
                         ids=["eagle", "medusa", "prophet", "exit-head"])
def test_training_records_its_teacher_and_a_resume_keeps_it(q4_target, tmp_path, capsys, command):
    write_shards(tmp_path / "shards", 267)

    def train(out, teacher, *extra):
        return main(["train", *command, "--target", str(q4_target), "--data", str(tmp_path / "shards"),
                     "--out", str(tmp_path / out), "--steps", "2", "--seq-len", "16", "--batch-size", "2",
                     "--eval-tokens", "64", "--probe-every", "0", "--threads", "1", "--no-progress",
                     *(["--teacher", teacher] if teacher else []), *extra])

    assert train("auto", None) == 0
    assert "run on its file's own quantized weights" in capsys.readouterr().err
    assert train("float32", "float32") == 0
    reports = {name: json.loads((tmp_path / name / "train_report.json").read_text()) for name in ("auto", "float32")}
    assert reports["auto"]["teacher"] == "quantized" and reports["float32"]["teacher"] == "float32"
    assert "`--teacher auto`" in (tmp_path / "auto" / "README.md").read_text()
    assert "`--teacher auto`" not in (tmp_path / "float32" / "README.md").read_text()
    # The same windows and seed: only the teacher's weights tell the two runs apart.
    assert (tmp_path / "auto" / "model.safetensors").read_bytes() != (tmp_path / "float32" / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert train("float32", None, "--resume", "--steps", "3") == 2
    err = capsys.readouterr().err
    assert "teacher: float32 -> quantized" in err and "Traceback" not in err
    # A run recorded before --teacher existed learned from float32 passes: it resumes so.
    run = tmp_path / "float32-work" / "run.json"
    run.write_text(json.dumps({k: v for k, v in json.loads(run.read_text()).items() if k != "teacher"}))
    assert train("float32", "float32", "--resume", "--steps", "3") == 0
