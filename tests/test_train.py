"""quickdraft train: corpus split, tokenizer, end-to-end tiny run, resume, embedded models."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from quickdraft.models.registry import ASSETS_DIR  # noqa: E402
from quickdraft.train import cli as train_cli  # noqa: E402
from quickdraft.train.corpus import is_validation, list_source_files, load_corpus  # noqa: E402
from quickdraft.train.presets import DRAFT_NAME, TARGET_NAME, get_preset  # noqa: E402
from quickdraft.train.tokenizer import token_byte_lengths, train_tokenizer  # noqa: E402

ROUNDTRIP = [
    "def f(x):\n    return x  \t\n\n\n",
    "héllo wörld — ünïcödé ✓ 🐍🚀 中文 日本語 한국어 Ελληνικά",
    "   leading spaces and trailing   ",
    "\t\ttabs\r\nCRLF\rCR\x00nul\x7f",
    "        " * 9 + "deep = 1",
    "<|endoftext|> in the middle <|endoftext|>",
    "",
    " ",
    "\u00a0nbsp\u200bzwsp\ufeffbom",
    "emoji zwj 👩‍👩‍👧 flags 🇫🇷",
]


def _make_corpus(root: Path, n: int = 24) -> Path:
    """A small synthetic package of .py files, plus files the corpus must ignore."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        body = textwrap.dedent(f'''\
            """Module number {i}: helpers for thing {i}."""

            import os
            import sys


            class Thing{i}:
                def __init__(self, value={i}):
                    self.value = value

                def compute(self, x):
                    if x > {i}:
                        return x * self.value
                    return [y for y in range(x) if y % 2 == 0]


            def main(argv=None):
                thing = Thing{i}()
                print(thing.compute(len(sys.argv)), os.getcwd())
                return 0
            ''')
        sub = root / f"pkg{i % 3}"
        sub.mkdir(exist_ok=True)
        (sub / f"mod{i}.py").write_text(body * 3, encoding="utf-8")
    (root / "unicode_mod.py").write_text("s = 'héllo 🐍'\n" * 20, encoding="utf-8")
    (root / "latin1_mod.py").write_bytes(b"s = '\xe9\xe8'\n")  # not UTF-8: skipped
    for excluded in ("site-packages/foo", "test", "pkg0/tests", "idlelib/idle_test"):
        d = root / excluded
        d.mkdir(parents=True, exist_ok=True)
        (d / "excluded.py").write_text("x = 1\n")
    return root


# ------------------------------------------------------------------------ corpus


def test_split_is_deterministic_and_by_file(tmp_path):
    root = _make_corpus(tmp_path / "src")
    a, b = load_corpus(root), load_corpus(root)
    assert [p for p, _ in a.train] == [p for p, _ in b.train]
    assert [p for p, _ in a.val] == [p for p, _ in b.val]
    assert a.manifest() == b.manifest()
    # the split of a path never depends on the other files
    paths = [f"pkg/mod{i}.py" for i in range(2000)]
    flags = [is_validation(p) for p in paths]
    assert flags == [is_validation(p) for p in paths]
    assert 0.03 < sum(flags) / len(flags) < 0.07
    assert set(a.train).isdisjoint(a.val)


def test_corpus_excludes_tests_site_packages_and_counts_undecodable(tmp_path):
    root = _make_corpus(tmp_path / "src")
    files = list_source_files(root)
    assert not any("excluded.py" in f for f in files)
    assert any("excluded.py" in f for f in list_source_files(root, include_tests=True))
    assert not any("site-packages" in f for f in list_source_files(root, include_tests=True))
    c = load_corpus(root)
    m = c.manifest()
    assert m["skipped_undecodable"] == 1 and c.skipped == ["latin1_mod.py"]
    assert m["files"] == m["split"]["train_files"] + m["split"]["val_files"] == 25
    assert m["bytes"] == m["split"]["train_bytes"] + m["split"]["val_bytes"]
    assert m["split"]["val_files"] >= 1
    assert len(m["sha256"]) == 64 and m["python_version"]


# ------------------------------------------------------------------------ tokenizer


def test_tokenizer_roundtrip_exact(tmp_path):
    root = _make_corpus(tmp_path / "src")
    tok = train_tokenizer(load_corpus(root).train_texts, vocab_size=400)
    tok.save_pretrained(tmp_path / "tok")
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    for t in (tok, loaded):
        assert t.eos_token == t.bos_token == t.pad_token == "<|endoftext|>"
        assert t.convert_tokens_to_ids("<|endoftext|>") == 0
        for s in ROUNDTRIP:
            ids = t.encode(s)
            assert t.decode(ids) == s, repr(s)
        ids = t.encode("def x")
        assert ids and ids[0] != 0, "no bos must be added by default"
    lengths = token_byte_lengths(loaded)
    for s in ROUNDTRIP:
        assert sum(lengths[i] for i in loaded.encode(s) if i != 0) == len(
            s.replace("<|endoftext|>", "").encode("utf-8"))


# ------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("train")
    root = _make_corpus(base / "src")
    out = base / "out"
    rc = train_cli.main(["--out", str(out), "--preset", "tiny", "--corpus-root", str(root),
                         "--no-progress", "--threads", "1", "--seed", "3"])
    assert rc == 0
    return out


def test_train_end_to_end_outputs(tiny_run):
    out = tiny_run
    for name, role in ((TARGET_NAME, "target"), (DRAFT_NAME, "draft")):
        d = out / name
        names = {p.name for p in d.iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "README.md", "quickdraft.json", "loss_curve.png", "train_log.jsonl"} <= names
        assert not any(n.endswith((".bin", ".pt", ".pth", ".pkl")) for n in names)
        meta = json.loads((d / "quickdraft.json").read_text())
        assert meta["name"] == name and meta["role"] == role
        assert meta["default"] is (role == "target")
        if role == "target":
            assert meta["draft"] == DRAFT_NAME
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["model_type"] == "llama"
        assert (cfg.get("dtype") or cfg.get("torch_dtype")) == "bfloat16"
        model = transformers.AutoModelForCausalLM.from_pretrained(d)
        assert next(model.parameters()).dtype == torch.bfloat16
        assert sum(p.numel() for p in model.parameters()) == meta["params"]
        tok = transformers.AutoTokenizer.from_pretrained(d)
        assert tok.decode(tok.encode(ROUNDTRIP[1])) == ROUNDTRIP[1]
        ids = torch.tensor([tok.encode("def main(")])
        gen = model.generate(ids, max_new_tokens=4, do_sample=False)
        assert gen.shape[1] == ids.shape[1] + 4
        card = (d / "README.md").read_text()
        assert "bits per byte" in card and "ms / token" in card and "quickdraft train" in card
        assert '"sha256"' in card and "python_version" in card
        log = [json.loads(x) for x in (d / "train_log.jsonl").read_text().splitlines()]
        assert log[-1]["event"] == "eval" and log[-1]["bpb"] > 0
        assert any(r.get("event") == "train" for r in log)
    results = json.loads((out / "_work" / "results.json").read_text())
    assert results["draft"]["val"]["greedy_agreement"] >= 0
    assert results["decode_ms"]["target"] > 0 and results["decode_ms"]["draft"] > 0
    # checkpoints are safetensors + JSON, never pickles
    ck = list((out / "_work" / "target" / "checkpoints").rglob("*"))
    assert ck and all(p.is_dir() or p.suffix in (".safetensors", ".json") for p in ck)


def test_registry_reads_trained_dir(tiny_run):
    from quickdraft.models import registry

    models = registry.list_models(tiny_run)
    assert [m.name for m in models] == [TARGET_NAME, DRAFT_NAME]
    assert models[0].default and models[0].draft == DRAFT_NAME


def test_add_train_parser_wires_subcommand(tmp_path):
    import argparse

    parser = argparse.ArgumentParser(prog="quickdraft")
    sub = parser.add_subparsers(dest="command")
    train_cli.add_train_parser(sub)
    args = parser.parse_args(["train", "--out", str(tmp_path), "--preset", "tiny",
                              "--stage", "target", "--resume", "--threads", "auto"])
    assert args.func is train_cli.run_train
    assert args.preset == "tiny" and args.stage == "target" and args.resume
    assert args.threads == "auto" and args.out == tmp_path


def test_cli_resume_from_finished_run_is_a_no_op(tiny_run):
    from safetensors.torch import load_file

    path = tiny_run / TARGET_NAME / "model.safetensors"
    before = load_file(path)
    rc = train_cli.main(["--out", str(tiny_run), "--preset", "tiny", "--stage", "target",
                         "--resume", "--no-progress", "--threads", "1", "--seed", "3",
                         "--corpus-root", str(tiny_run.parent / "src")])
    assert rc == 0
    after = load_file(path)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    res = json.loads((tiny_run / "_work" / "results.json").read_text())
    assert res["target"]["resumed_from"] == "step-000006"


def test_rerunning_one_stage_keeps_the_other_models_command(tiny_run):
    target_card = tiny_run / TARGET_NAME / "README.md"
    before = [line for line in target_card.read_text().splitlines() if line.startswith("- command:")]
    rc = train_cli.main(["--out", str(tiny_run), "--preset", "tiny", "--stage", "draft",
                         "--resume", "--no-progress", "--threads", "1", "--seed", "3",
                         "--corpus-root", str(tiny_run.parent / "src")])
    assert rc == 0
    after = [line for line in target_card.read_text().splitlines() if line.startswith("- command:")]
    assert before and after == before
    draft_card = (tiny_run / DRAFT_NAME / "README.md").read_text()
    assert "--stage draft" in draft_card


# ------------------------------------------------------------------------ resume


def test_resume_continues_exactly(tmp_path):
    from quickdraft.train.data import encode_docs
    from quickdraft.train.trainer import build_model, train_loop

    torch.set_num_threads(1)
    root = _make_corpus(tmp_path / "src")
    corpus = load_corpus(root)
    tok = train_tokenizer(corpus.train_texts, vocab_size=300)
    stream = encode_docs(tok, corpus.train_texts)
    p = get_preset("tiny")
    stage = p.target_stage  # 6 steps, checkpoint every 3

    ref = build_model(p.target, p, seed=5)
    train_loop(ref, stream, stage, p.seq_len, 5, tmp_path / "a", tmp_path / "a.jsonl",
               progress=False)

    class Crash(Exception):
        pass

    calls = {"n": 0}

    def crashing_loss(model, batch):
        from quickdraft.train.trainer import ce_loss

        calls["n"] += 1
        if calls["n"] == 5:
            raise Crash
        return ce_loss(model, batch)

    m = build_model(p.target, p, seed=5)
    with pytest.raises(Crash):
        train_loop(m, stream, stage, p.seq_len, 5, tmp_path / "b", tmp_path / "b.jsonl",
                   loss_fn=crashing_loss, progress=False)
    m2 = build_model(p.target, p, seed=99)  # different init: everything must come from the ckpt
    summary = train_loop(m2, stream, stage, p.seq_len, 5, tmp_path / "b", tmp_path / "b.jsonl",
                         resume=True, progress=False)
    assert summary["resumed_from"] == "step-000003"
    for (n1, a), (_, b) in zip(ref.state_dict().items(), m2.state_dict().items(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), n1
    steps = [json.loads(x)["step"] for x in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 7))


# ------------------------------------------------------------------------ embedded models

_HAVE_ASSETS = all((ASSETS_DIR / n / "model.safetensors").exists() for n in (TARGET_NAME, DRAFT_NAME))


@pytest.mark.skipif(not _HAVE_ASSETS, reason="embedded models not trained yet")
def test_embedded_family_loads():
    from quickdraft.models import registry

    target = registry.default_target()
    assert target is not None and target.name == TARGET_NAME and target.role == "target"
    draft = registry.paired_draft(target)
    assert draft is not None and draft.name == DRAFT_NAME and draft.role == "draft"
    assert target.params >= 12_000_000
    total = 0
    toks = []
    for m in (target, draft):
        model = transformers.AutoModelForCausalLM.from_pretrained(m.path)
        assert sum(p.numel() for p in model.parameters()) == m.params
        tok = transformers.AutoTokenizer.from_pretrained(m.path)
        for s in ROUNDTRIP:
            assert tok.decode(tok.encode(s)) == s
        toks.append(tok.get_vocab())
        total += sum(f.stat().st_size for f in m.path.iterdir())
        assert (m.path / "README.md").exists() and (m.path / "loss_curve.png").exists()
    assert toks[0] == toks[1], "target and draft must share the tokenizer"
    assert total < 60 * 1024 * 1024
