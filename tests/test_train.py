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
from quickdraft.train.tokenizer import (  # noqa: E402
    CODE_CHAT_TEMPLATE_FILE,
    token_byte_lengths,
    train_tokenizer,
)

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
        assert t.chat_template == CODE_CHAT_TEMPLATE_FILE.read_text()  # what the embedded models ship
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


# ------------------------------------------------------------------------ model cards


def _card_inputs() -> tuple[dict, dict]:
    """A fixed ``results.json`` and ``config.json`` that reach every branch of write_card."""
    buckets = [{"start": 0, "end": 128, "tokens": 4096, "loss": 1.25},
               {"start": 128, "end": 256, "tokens": 4000, "loss": None}]
    hw = {"platform": "Linux-6.1-x86_64", "processor": "", "machine": "x86_64", "cpu_count": 2,
          "torch": "2.5.0", "threads": 2, "transformers": "4.46.0", "python": "3.11.9"}
    stage = {"steps": 450, "batch_size": 12, "tokens": 1382400, "weight_decay": 0.1, "lr": 0.0015,
             "warmup": 25, "grad_clip": 1.0, "train_time_s": 4321.0, "final_train_loss": 1.23456}
    results = {
        "command": "quickdraft train --out runs/v1 --threads auto",
        "seed": 0,
        "preset": {"seq_len": 256, "ce_weight": 0.1},
        "corpus": {"files": 10, "bytes": 123456, "python_version": "3.11.9", "sha256": "ab" * 32,
                   "split": {"method": "sha256(path) < 0.05", "val_files": 3, "val_bytes": 20000}},
        "stream": {"train_tokens": 1234567, "val_tokens": 54321},
        "hardware": hw,
        "decode_ms": {"target": 6.4615, "draft": 0.9251, "threads": 2, "steps": 64,
                      "prompt_len": 32, "repeats": 5},
        "stage_wall_s": {"target": 4500.0},
        "val_code_only": {"excluded": ["pydoc_data/topics.py"], "files": 2, "bytes": 8000,
                          "target": {"loss": 1.5, "bpb": 0.6},
                          "draft": {"loss": 2.5, "bpb": 0.9, "greedy_agreement": 0.61}},
        "target_init": "runs/v0/qd-stdlib-target",
        "target_init_val": {"position_buckets": [{**b, "loss": 1.5} for b in buckets]},
        "target": {**stage, "params": 23_000_000,
                   "val": {"loss": 1.4, "bpb": 0.55, "tokens": 8096, "bytes": 30000,
                           "position_buckets": buckets},
                   "train_eval": {"tokens": 1024, "loss": 1.3, "bpb": 0.5}},
        "draft": {**stage, "params": 2_900_000, "command": "quickdraft train --stage draft",
                  "val": {"loss": 2.4, "bpb": 0.95, "tokens": 8096, "bytes": 30000,
                          "kl_from_target": 0.8, "greedy_agreement": 0.6,
                          "position_buckets": buckets},
                  "train_eval": {"tokens": 1024, "loss": 2.3, "bpb": 0.9}},
    }
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 448, "num_hidden_layers": 8,
              "num_attention_heads": 7, "num_key_value_heads": 7, "intermediate_size": 1216,
              "vocab_size": 8192, "max_position_embeddings": 2048, "tie_word_embeddings": True}
    return results, config


def _card_variants() -> dict[str, dict]:
    """Results with and without each optional part (timing, code-only rows, buckets, ...)."""
    full, _ = _card_inputs()
    bare = json.loads(json.dumps(full))
    for key in ("decode_ms", "stage_wall_s", "val_code_only", "target_init", "target_init_val"):
        del bare[key]
    bare["command"] = "quickdraft train --out runs/v1"
    bare["hardware"]["processor"] = "Intel(R) Xeon(R)"
    for role in ("target", "draft"):
        del bare[role]["val"]["position_buckets"]
    return {"full": full, "bare": bare}


# sha256 of the README.md card.write_card writes for each variant/role: pins the cards byte
# for byte, so restructuring write_card cannot change what it writes. A deliberate change to
# the card's text updates these (the test's assertion shows the new values).
CARD_SHA256 = {
    "full/target": "0d20467278370b2a1ff84e532f604ebed4661d9ccac0c56d02294feba25382d6",
    "full/draft": "5274bbb9cdb100160a4d6c028d0355e1110b78158fbc89a64dfd979b97752808",
    "bare/target": "6833f9adbe0b2be0315e6e63dd5fab90b9cbae52f522512b16d71e22cbfa8ae9",
    "bare/draft": "3291ea708e801fcf6d58c5f6ecb100f66bb87b2b97f1458695e892ab7ef6fdd1",
}


def test_write_card_output_is_pinned(tmp_path):
    import hashlib

    from quickdraft.train import card

    _, config = _card_inputs()
    got = {}
    for variant, results in _card_variants().items():
        for role in ("target", "draft"):
            d = tmp_path / f"{variant}-{role}"
            d.mkdir()
            (d / "config.json").write_text(json.dumps(config))
            card.write_card(d, role, results)
            text = (d / "README.md").read_text()
            got[f"{variant}/{role}"] = hashlib.sha256(text.encode()).hexdigest()
            headings = [line for line in text.splitlines() if line.startswith("## ")]
            assert headings == ["## Architecture", "## Results", "## Decode cost", "## Training",
                                "## Tokenizer", "## Corpus"], headings
            assert (d / "position_loss.png").exists() == (variant == "full")
            assert ("## Decode cost\n\n(measured once the draft is trained)" in text) == (variant == "bare")
    assert got == CARD_SHA256


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
