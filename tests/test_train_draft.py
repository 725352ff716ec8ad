"""quickdraft train draft: a draft for any target, pairing, resume after Ctrl-C, bad input;
and training never writes into the package unless told (issue #8)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from conftest import build_tokenizer, save_llama
from safetensors.torch import load_file

from quickdraft import cli
from quickdraft.models.registry import ASSETS_DIR, PACKAGE_DIR, find_draft_dir, register_draft

CODE = '''def mean(values):
    """The arithmetic mean of a non-empty sequence."""
    total = 0
    for v in values:
        total += v
    return total / len(values)


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key):
        self.counts[key] = self.counts.get(key, 0) + 1
'''


@pytest.fixture(autouse=True)
def user_config(tmp_path, monkeypatch):
    """Pairings go to a per-test config dir, never the user's."""
    monkeypatch.setenv("QUICKDRAFT_CONFIG_DIR", str(tmp_path / "config"))
    return tmp_path / "config"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny random Llama target with its own tokenizer, and a data directory."""
    root = tmp_path_factory.mktemp("train_draft")
    tok = build_tokenizer(root / "target")
    save_llama(root / "target", len(tok), layers=2, hidden=64, seed=0, eos=tok.eos_token_id,
               scale=20.0)
    data = root / "data"
    (data / "pkg").mkdir(parents=True)
    for i in range(12):
        (data / "pkg" / f"mod{i}.py").write_text(CODE.replace("mean", f"mean{i}") * 2)
    rows = [{"text": CODE.replace("Counter", f"Tally{i}")} for i in range(6)] + [{"id": 1}]
    (data / "extra.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (data / "blob.bin").write_bytes(bytes(range(256)))  # binary: skipped
    return root


def train_draft(setup, out: Path, *extra: str) -> int:
    return cli.main(["train", "draft", "--target", str(setup / "target"), "--out", str(out),
                     "--data", str(setup / "data"), "--config", "tiny", "--steps", "6",
                     "--seq-len", "32", "--batch-size", "2", "--ckpt-every", "3",
                     "--eval-tokens", "256", "--threads", "1", "--no-progress", *extra])


def test_train_draft_end_to_end_pairs_and_is_lossless(setup, tmp_path, user_config):
    from quickdraft.generator import SpeculativeGenerator
    from quickdraft.models.lm import load_model
    from quickdraft.models.loading import resolve_pair

    out = tmp_path / "draft"
    assert train_draft(setup, out, "--draft-vocab", "128") == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md", "quickdraft.json",
            "loss_curve.png", "train_log.jsonl", "data_manifest.json", "draft_vocab.json"} <= names
    vocab = json.loads((out / "draft_vocab.json").read_text())
    assert vocab["size"] == 128 and sorted(vocab["ranking"]) == list(range(len(vocab["ranking"])))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 256  # the target's context
    meta = json.loads((out / "quickdraft.json").read_text())
    assert meta["role"] == "draft" and meta["target_path"] == str((setup / "target").resolve())
    assert load_model(out).backend == "native"
    # the data manifest counts the .py files and the JSONL records, not the binary
    manifest = json.loads((out / "data_manifest.json").read_text())
    assert manifest["files"] == 13 and manifest["skipped"] == 2
    assert manifest["split"]["train_tokens"] > 0 and manifest["split"]["heldout_tokens"] > 0
    card = (out / "README.md").read_text()
    assert "greedy agreement" in card and "draft / target cost ratio" in card
    assert "scoring only the draft vocabulary (128 most frequent tokens" in card
    assert "quickdraft train draft --target" in card and "6 of 6 steps" in card
    # generate --model TARGET finds the draft (pairing file), and greedy output is unchanged
    assert resolve_pair(str(setup / "target"), None, need_draft=True)[1] == out
    spec = SpeculativeGenerator.from_pretrained(str(setup / "target"))
    full = SpeculativeGenerator.from_pretrained(str(setup / "target"), draft_vocab=0)
    assert spec.drafter.model.model.head_ids.tolist() == vocab["ranking"][:128]
    assert full.drafter.model.model.head_ids is None
    plain = SpeculativeGenerator.from_pretrained(str(setup / "target"), method="ar")
    for prompt in ("def mean(values):", "class Counter:\n    def"):
        # k given: the cost model may well find this 6-step draft not worth running
        a = spec.generate(prompt, max_new_tokens=40, num_speculative_tokens=4)
        b = plain.generate(prompt, max_new_tokens=40)
        assert a.token_ids == b.token_ids == full.generate(prompt, max_new_tokens=40, num_speculative_tokens=4).token_ids
        assert a.stats.drafted_tokens > 0


@pytest.mark.slow  # 10-20 s: sorted first (conftest.py), never a worker's last test
def test_interrupted_then_resumed_equals_uninterrupted(setup, tmp_path, monkeypatch, capsys):
    from quickdraft.models.lm import load_model
    from quickdraft.train import trainer

    assert train_draft(setup, tmp_path / "a") == 0
    real = trainer.sample_batch

    def ctrl_c_at_step_4(stream, batch_size, seq_len, seed, step, answers=None):
        if step == 3:  # a real SIGINT through the real handler, during the 4th step
            os.kill(os.getpid(), signal.SIGINT)
        return real(stream, batch_size, seq_len, seed, step, answers)

    monkeypatch.setattr(trainer, "sample_batch", ctrl_c_at_step_4)
    assert train_draft(setup, tmp_path / "b") == 130
    assert "stopped at step 4/6" in capsys.readouterr().err
    assert load_model(tmp_path / "b").vocab_size > 0  # the stopped run left a usable draft
    assert "Stopped by Ctrl-C at step 4" in (tmp_path / "b" / "README.md").read_text()
    monkeypatch.setattr(trainer, "sample_batch", real)
    assert train_draft(setup, tmp_path / "b", "--resume") == 0
    a = load_file(tmp_path / "a-work" / "checkpoints" / "step-000006" / "model.safetensors")
    b = load_file(tmp_path / "b-work" / "checkpoints" / "step-000006" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k
    # resuming a finished run redoes only the outputs; the card keeps the last loss
    assert train_draft(setup, tmp_path / "b", "--resume", "--force") == 0
    assert "final train objective nan" not in (tmp_path / "b" / "README.md").read_text()
    # resuming with other settings is refused
    assert train_draft(setup, tmp_path / "b", "--resume", "--lr", "1e-2") == 2


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("quickdraft: error:"), err
    return err[0]


def test_bad_input_is_one_line_exit_2(setup, tmp_path, capsys):
    base = ["train", "draft", "--steps", "1", "--seq-len", "16", "--no-progress"]
    target, data = str(setup / "target"), str(setup / "data")
    (tmp_path / "empty").mkdir()
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "x.bin").write_bytes(b"\x00\xff" * 10)
    (tmp_path / "noconfig").mkdir()
    other = tmp_path / "other-init"  # a draft with another tokenizer
    tok = build_tokenizer(other, vocab_size=280)
    save_llama(other, len(tok), layers=1, hidden=32, seed=1, eos=tok.eos_token_id)
    cases = {
        "not loadable": ["--target", str(tmp_path / "missing"), "--data", data],
        "no config.json": ["--target", str(tmp_path / "noconfig"), "--data", data],
        "no data files": ["--target", target, "--data", str(tmp_path / "empty")],
        "empty beside data": ["--target", target, "--data", data, str(tmp_path / "empty")],
        "no data path": ["--target", target, "--data", str(tmp_path / "nope.txt")],
        "no usable text": ["--target", target, "--data", str(tmp_path / "binary")],
        "inside package": ["--target", target, "--data", data],
        "other tokenizer": ["--target", target, "--data", data, "--init", str(other)],
        "seq-len over context": ["--target", target, "--data", data, "--seq-len", "4096"],
        "draft vocab over vocab": ["--target", target, "--data", data, "--draft-vocab", "100000"],
    }
    messages = {}
    capsys.readouterr()
    for case, args in cases.items():
        out = ASSETS_DIR / "qd-test-draft" if case == "inside package" else tmp_path / case
        size = [] if "--init" in args else ["--config", "tiny"]
        assert cli.main([*base, *size, "--out", str(out), *args]) == 2, case
        messages[case] = _one_line_error(capsys)
        assert not out.exists(), case
    assert "inside the installed quickdraft package" in messages["inside package"]
    assert "different tokenizers" in messages["other tokenizer"]
    assert "no usable text" in messages["no usable text"]
    assert "no data files" in messages["no data files"]
    assert f"no data files with text in {tmp_path / 'empty'};" in messages["empty beside data"]
    assert "--draft-vocab 100000 is more than the target's" in messages["draft vocab over vocab"]


def test_train_never_writes_into_the_package_unless_forced(tmp_path, capsys, monkeypatch):
    from quickdraft.train import pipeline

    def refuse(*args, **kwargs):  # guard: if the check regresses, fail instead of training
        raise AssertionError("training started")

    monkeypatch.setattr(pipeline.Pipeline, "__init__", refuse)
    assert cli.main(["train", "--preset", "tiny", "--no-progress"]) == 2
    assert "--out" in _one_line_error(capsys)
    assert cli.main(["train", "--preset", "tiny", "--out", str(ASSETS_DIR)]) == 2
    assert "--force" in _one_line_error(capsys)
    assert cli.main(["train", "--preset", "tiny", "--out", str(PACKAGE_DIR / "x")]) == 2
    _one_line_error(capsys)
    with pytest.raises(AssertionError, match="training started"):  # --force is allowed
        cli.main(["train", "--preset", "tiny", "--force"])


def test_pairing_rules(tmp_path):
    target, draft = tmp_path / "t", tmp_path / "d"
    target.mkdir()
    draft.mkdir()
    assert find_draft_dir(target) is None
    # the user's pairing file counts only while the draft still names this target
    register_draft(target, draft)
    assert find_draft_dir(target) is None
    (draft / "quickdraft.json").write_text(json.dumps(
        {"role": "draft", "target_path": str(target.resolve())}))
    assert find_draft_dir(target) == draft.resolve()
    # the target's own quickdraft.json wins, a path relative to the target's directory
    (tmp_path / "d2").mkdir()
    (target / "quickdraft.json").write_text(json.dumps({"draft": "../d2"}))
    assert find_draft_dir(target).resolve() == (tmp_path / "d2").resolve()


def test_data_stdlib_is_the_corpus_train_split_with_its_validation_held_out():
    from quickdraft.train.corpus import load_corpus
    from quickdraft.train.textdata import read_text_data

    data = read_text_data(["stdlib"])
    corpus = load_corpus()
    assert [n for n, _ in data.train] == [n for n, _ in corpus.train]
    assert [n for n, _ in data.heldout] == [n for n, _ in corpus.val]
    assert data.manifest()["files"] == len(corpus.train) + len(corpus.val)


def test_init_draft_gets_the_targets_context(setup, tmp_path):
    init = tmp_path / "init"  # a draft with the target's tokenizer and a shorter context
    tok = build_tokenizer(init)
    save_llama(init, len(tok), layers=1, hidden=32, seed=2, eos=tok.eos_token_id)
    cfg = json.loads((init / "config.json").read_text())
    (init / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 64}))
    out = tmp_path / "draft"
    assert cli.main(["train", "draft", "--target", str(setup / "target"), "--out", str(out),
                     "--data", str(setup / "data"), "--init", str(init), "--steps", "1",
                     "--seq-len", "128", "--batch-size", "1", "--eval-tokens", "128",
                     "--no-progress"]) == 0
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 256
    assert "Initialised from" in (out / "README.md").read_text()


def test_package_sources_export_records_versions_and_keeps_bench_packages_out(tmp_path, capsys):
    from importlib import metadata

    from quickdraft.train import packages
    from quickdraft.train.textdata import read_text_data

    out, manifest_path = tmp_path / "code", tmp_path / "manifest.json"
    assert packages.main(["pluggy", "pytest:_pytest", "--out", str(out), "--manifest", str(manifest_path),
                          "--max-bytes", "60000"]) == 0
    manifest = json.loads(manifest_path.read_text())
    by_name = {p["package"]: p for p in manifest["packages"]}
    assert by_name["pluggy"]["version"] == metadata.version("pluggy")
    assert by_name["_pytest"]["distribution"] == "pytest" and by_name["_pytest"]["license"] != "unknown"
    assert all(0 < p["bytes"] <= 60000 for p in manifest["packages"])
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.py"))
    assert len(files) == sum(p["files"] for p in manifest["packages"])
    assert not [f for f in files if "/tests/" in f or f.split("/")[-1].startswith("test_")]
    data = read_text_data([str(out)])  # what `train draft --data` reads
    assert len(data.train) + len(data.heldout) == len(files)
    # The bench's out-of-domain packages, unknown packages and a manifest inside --out: one line, exit 2
    for argv in (["rich", "--out", str(tmp_path / "x"), "--manifest", str(tmp_path / "m.json")],
                 ["no_such_package_qd", "--out", str(tmp_path / "y"), "--manifest", str(tmp_path / "m.json")],
                 ["pluggy", "--out", str(out), "--manifest", str(out / "m.json")]):
        capsys.readouterr()
        assert packages.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1
    assert not (tmp_path / "x").exists()


def test_onpolicy_data_is_the_targets_own_greedy_continuation(setup, tmp_path, capsys):
    from quickdraft.generator import SpeculativeGenerator
    from quickdraft.train import onpolicy

    out = tmp_path / "onpolicy.jsonl"
    assert onpolicy.main(["--target", str(setup / "target"), "--data", str(setup / "data"), "--out", str(out),
                          "--prompts", "4", "--max-new-tokens", "12", "--batch-size", "2", "--no-progress"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and all(r["new_tokens"] > 0 for r in rows)
    plain = SpeculativeGenerator.from_pretrained(str(setup / "target"), method="ar")
    for r in rows:
        prompt = r["text"][:r["prompt_chars"]]
        assert prompt.strip() and r["source"].startswith(("pkg/", "extra.jsonl#"))
        assert r["text"][r["prompt_chars"]:] == plain.generate(prompt, max_new_tokens=12).text
    # prompts come from the training split only (read_text_data's held-out names never appear)
    from quickdraft.train.textdata import read_text_data
    heldout = {name for name, _ in read_text_data([str(setup / "data")]).heldout}
    assert not heldout & {r["source"] for r in rows}
    capsys.readouterr()
    assert onpolicy.main(["--data", str(tmp_path / "missing"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: data path") and "\n" not in err


# --------------------------------------------------------------- draft size and cost ratio


def _meta_llama(config=None, **cfg):
    """A Llama of these shapes on the meta device: no weights allocated, so any size is fast."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(config or LlamaConfig(**cfg))


def test_cost_estimate_counts_the_matrices_a_decode_step_reads():
    from quickdraft.train import sizing
    from quickdraft.train.presets import FAMILY_DRAFT, FAMILY_TARGET, Arch
    from quickdraft.train.trainer import llama_config

    for arch in (FAMILY_DRAFT, FAMILY_TARGET, Arch(96, 3, 3, 256, num_key_value_heads=1)):
        model = _meta_llama(llama_config(arch, 8192, 512))
        assert sizing.matmul_params(model) == sizing.llama_matmul_params(arch, 8192)
        assert sizing.matmul_params(model, 1024) == sizing.llama_matmul_params(arch, 1024)
        assert sizing.decode_cost(model, 1024) == sizing.arch_cost(arch, 1024)
    assert sizing.poor_ratio_warning(0.5, "estimated") is None
    line = sizing.poor_ratio_warning(0.97, "measured")
    assert "0.97 x the target's" in line and "--config" in line and "--method ngram" in line
    assert "\n" not in line


def test_default_draft_is_a_tenth_of_a_large_target_and_smaller_than_a_tiny_one(setup):
    from transformers import AutoModelForCausalLM

    from quickdraft.models.draft_vocab import default_vocab_size
    from quickdraft.train import sizing
    from quickdraft.train.presets import FAMILY_DRAFT, FAMILY_TARGET
    from quickdraft.train.trainer import llama_config

    # the embedded family's target gets the hand-picked family draft (1 layer x 256)
    family = _meta_llama(llama_config(FAMILY_TARGET, 8192, 2048))
    assert sizing.default_draft_arch(family, default_vocab_size(8192)) == FAMILY_DRAFT
    # larger targets: about a tenth of their step, never deeper or wider than the target
    for cfg in ({"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
                 "num_hidden_layers": 16, "num_attention_heads": 16},
                {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                 "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3}):
        target = _meta_llama(**cfg)
        rows = default_vocab_size(cfg["vocab_size"])
        arch = sizing.default_draft_arch(target, rows)
        ratio = sizing.arch_cost(arch, rows) / sizing.decode_cost(target)
        assert 0.05 < ratio <= 0.1, (cfg, arch, ratio)
        assert arch.hidden_size <= cfg["hidden_size"] and arch.num_hidden_layers <= cfg["num_hidden_layers"]
    # the tests' tiny target (2 x 64): too small for a cheap draft, but the default is smaller
    tiny = AutoModelForCausalLM.from_pretrained(setup / "target")
    vocab = tiny.config.vocab_size
    arch = sizing.default_draft_arch(tiny, default_vocab_size(vocab))
    assert (arch.num_hidden_layers, arch.hidden_size) < (2, 64)
    assert arch.num_hidden_layers <= 2 and arch.hidden_size <= 64
    assert sizing.arch_cost(arch, vocab) < sizing.decode_cost(tiny)
    assert sizing.llama_matmul_params(arch, vocab) < sizing.matmul_params(tiny)
    # one layer 16 wide has no smaller draft: a one-line error, not a draft as big as it
    with pytest.raises(ValueError, match="too small for a smaller draft"):
        sizing.default_draft_arch(_meta_llama(vocab_size=300, hidden_size=16, intermediate_size=32,
                                              num_hidden_layers=1, num_attention_heads=1))


@pytest.mark.slow  # 10-20 s: sorted first (conftest.py), never a worker's last test
def test_default_draft_is_smaller_than_the_target_and_a_too_large_one_warns(setup, tmp_path, capsys):
    args = ["train", "draft", "--target", str(setup / "target"), "--data", str(setup / "data"),
            "--steps", "1", "--seq-len", "32", "--batch-size", "2", "--eval-tokens", "64",
            "--threads", "1", "--no-progress"]
    target = json.loads((setup / "target" / "config.json").read_text())
    assert cli.main([*args, "--out", str(tmp_path / "auto")]) == 0
    draft = json.loads((tmp_path / "auto" / "config.json").read_text())
    assert draft["num_hidden_layers"] <= target["num_hidden_layers"]
    assert draft["hidden_size"] <= target["hidden_size"]
    assert (draft["num_hidden_layers"], draft["hidden_size"]) != (target["num_hidden_layers"],
                                                                   target["hidden_size"])
    err = capsys.readouterr().err
    assert "(--config auto)" in err
    # a 2 x 64 target is too small for any draft to pay off: one line says to use another method
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "--method ngram" in warnings[0], err
    # a draft wider than the target: one warning line with the ratio and what to do
    big = json.dumps({"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "intermediate_size": 256})
    assert cli.main([*args, "--out", str(tmp_path / "big"), "--config", big]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1, warnings
    ratio = float(warnings[0].split("costs ")[1].split(" x")[0])
    assert ratio > 1 and "pass a smaller --config" in warnings[0]


def test_a_poor_measured_ratio_warns_when_the_estimate_did_not(setup, tmp_path, capsys, monkeypatch):
    from quickdraft.train import draft, sizing

    monkeypatch.setattr(sizing, "cost_ratio", lambda *a: 0.1)
    monkeypatch.setattr(draft, "measure_decode", lambda models, **kw: {"target": 1.0, "draft": 0.9})
    assert train_draft(setup, tmp_path / "d", "--steps", "1") == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "0.90 x the target's (measured" in warnings[0], warnings


@pytest.mark.parametrize("device", ["warp-drive", "cuda"])
def test_train_draft_bad_device_is_one_line(setup, tmp_path, capsys, device):
    """``--device`` (shared by draft, exit-head and heads) is checked before any training."""
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code = train_draft(setup, tmp_path / "d", "--device", device)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and ("not a torch device" in err or "CUDA" in err), err
    assert not (tmp_path / "d").exists()
