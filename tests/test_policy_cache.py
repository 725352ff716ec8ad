"""The cache of measured policy choices (policy/cache.py): one module fingerprints models and
machines, names the entries and reads and writes them, for all three measurements (auto-k,
--method auto, the batch policy)."""

import ast
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import quickdraft.policy as policy_pkg
from quickdraft.policy import autok, batch_policy, cache, method_choice
from quickdraft.policy.autok import AutoKResult, cached_k
from quickdraft.policy.batch_policy import BatchPolicy
from quickdraft.policy.cost_model import StepCosts
from quickdraft.policy.method_choice import MethodChoice, cached_method

COSTS = StepCosts(t_ar=1.0, t_draft=0.1, verify={n: 1.0 + 0.1 * n for n in range(1, 10)})
TABLE = {"calibrations": [{"context": 256, "verify": {"1": {"1": 1.0, "2": 1.1, "3": 1.2}},
                           "draft": {"1": 0.1}}]}


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "quickdraft" / "autok"


@pytest.fixture
def fake_measurements(monkeypatch):
    """Measurements that take no time (what is cached is what is tested here)."""
    calls = {"k": 0, "method": 0, "batch": 0}

    def calibrate(*args, **kwargs):
        calls["k"] += 1
        return AutoKResult(3, COSTS, [0.9, 0.8, 0.7], {1: 1.5, 2: 1.8, 3: 2.0, 4: 1.9})

    def choose_method(*args, **kwargs):
        calls["method"] += 1
        return MethodChoice("draft", 3, (), 2.0, {"draft k=3": (2.0, 3.0), "ar": (1.0, 1.0)}, COSTS)

    def measure_batch_costs(*args, **kwargs):
        calls["batch"] += 1
        return json.loads(json.dumps(TABLE))

    monkeypatch.setattr(autok, "calibrate", calibrate)
    monkeypatch.setattr(method_choice, "choose_method", choose_method)
    monkeypatch.setattr(batch_policy, "measure_batch_costs", measure_batch_costs)
    return calls


def _engine(target):
    return SimpleNamespace(drafter=None, max_batch_size=2, target=target, model=None, cache=None)


def test_every_cached_measurement_goes_through_the_cache_module(models, cache_home, fake_measurements,
                                                                monkeypatch):
    tok, target, drafts = models
    written = []
    real_write = cache.write_json
    monkeypatch.setattr(cache, "write_json", lambda path, data: (written.append(path), real_write(path, data)))
    first = (cached_k(target, drafts["perturbed"], tok), cached_method(target, drafts["perturbed"], tok),
             BatchPolicy.for_engine(_engine(target)))
    written = [p for p in written if p.parent == cache_home]  # not the file digests remembered
    kinds = sorted(p.name.split("-")[0] for p in written)
    assert kinds == ["batch", "k", "method"]
    assert sorted(p.name for p in cache_home.glob("*.json")) == sorted(p.name for p in written)
    assert fake_measurements == {"k": 1, "method": 1, "batch": 1}
    # Read back, not measured again.
    again = (cached_k(target, drafts["perturbed"], tok), cached_method(target, drafts["perturbed"], tok),
             BatchPolicy.for_engine(_engine(target)))
    assert fake_measurements == {"k": 1, "method": 1, "batch": 1}
    assert not again[0].measured and again[0].k == first[0].k
    assert not again[1].measured and again[1].label == first[1].label
    assert again[2].costs(1).t_ar == first[2].costs(1).t_ar
    for path in written:  # every entry carries the identity it is keyed by
        data = json.loads(path.read_text())
        assert data["machine"]["cpu"] and data["target"] and data["kind"] == path.name.split("-")[0]


def test_no_other_policy_module_hashes_or_writes_cache_files():
    """policy/cache.py is the only place that computes fingerprints and writes the files."""
    for path in Path(policy_pkg.__file__).parent.glob("*.py"):
        if path.name == "cache.py":
            continue
        tree = ast.parse(path.read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                    for alias in node.names} | {node.module for node in ast.walk(tree)
                                                if isinstance(node, ast.ImportFrom) and node.module}
        assert "hashlib" not in imported, path.name
        calls = {node.func.attr for node in ast.walk(tree)
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
        assert not calls & {"write_text", "replace", "sha256"}, path.name
        names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        assert not names & {"model_fingerprint", "machine_fingerprint"}, path.name


def test_an_unwritable_cache_still_gives_a_choice(models, tmp_path, monkeypatch, fake_measurements):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # a file: no directory can be made in it
    tok, target, drafts = models
    logged = []
    choice = cached_k(target, drafts["perturbed"], tok, log=logged.append)
    assert choice.k == 3 and choice.path is None and any("could not write" in line for line in logged)
    assert cached_method(target, drafts["perturbed"], tok).path is None
    assert BatchPolicy.for_engine(_engine(target)).costs(1).t_ar == 1.0


# --- keys: model content and machine, not paths ---------------------------------------------


def _load(path):
    from quickdraft.models.lm import load_model

    return load_model(path)


def test_copies_of_a_checkpoint_share_an_entry_and_a_perturbed_one_does_not(tiny_family, tmp_path, cache_home,
                                                                           fake_measurements, models):
    """An editable and a pip install of the same pair are two directories with the same
    files (new mtimes too): one cache entry. Different weights: another."""
    import shutil

    tok = models[0]
    elsewhere = tmp_path / "site-packages" / "target"
    shutil.copytree(tiny_family["target"], elsewhere, copy_function=shutil.copy)  # new path, new mtimes
    draft = _load(tiny_family["perturbed"])
    first = cached_k(_load(tiny_family["target"]), draft, tok)
    same = cached_k(_load(elsewhere), draft, tok)
    assert first.measured and not same.measured and same.path == first.path
    assert cached_k(_load(tiny_family["copy"]), draft, tok).path == first.path
    other = cached_k(_load(tiny_family["perturbed"]), draft, tok)  # perturbed weights as the target
    assert other.measured and other.path != first.path
    assert fake_measurements["k"] == 2
    assert len(list(cache_home.glob("k-*.json"))) == 2
    identity = json.loads(first.path.read_text())
    assert str(tiny_family["target"]) not in json.dumps(identity)  # no path in the key


def test_the_key_follows_machine_and_runtime_not_location(tiny_family, cache_home, monkeypatch):
    import torch

    target, copy = _load(tiny_family["target"]), _load(tiny_family["copy"])
    key = cache.entry("k", 1, {"target": target})
    assert cache.entry("k", 1, {"target": copy}).path == key.path
    assert cache.entry("k", 1, {"target": target}, max_k=6).path != key.path  # the caller's settings
    threads = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)
    assert cache.entry("k", 1, {"target": target}).path != key.path  # thread count
    monkeypatch.undo()
    real = cache.machine_fingerprint
    monkeypatch.setattr(cache, "machine_fingerprint", lambda: {**real(), "cpu": "another CPU"})
    assert cache.entry("k", 1, {"target": target}).path != key.path  # CPU model
    monkeypatch.undo()
    monkeypatch.setattr(target, "decode_linears", not target.decode_linears)
    assert cache.entry("k", 1, {"target": target}).path != key.path  # the runtime's kernels
    monkeypatch.undo()
    from quickdraft.models import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "fingerprint", lambda: "another build")
    assert cache.entry("k", 1, {"target": target}).path != key.path  # our compiled kernels
    monkeypatch.undo()
    target.model.to(torch.float64)
    try:
        assert cache.entry("k", 1, {"target": target}).path != key.path  # dtype
    finally:
        target.model.to(torch.float32)


def test_file_digests_are_content_hashes_computed_once(tmp_path, cache_home, monkeypatch):
    import hashlib
    import os

    data = b"weights" * 1000
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    a.write_bytes(data)
    b.write_bytes(data)
    os.utime(b, ns=(1, 1))
    assert cache.file_digest(a) == cache.file_digest(b) == hashlib.sha256(data).hexdigest()
    # Remembered: not read again while size, mtime and inode stay.
    monkeypatch.setattr("builtins.open", lambda *a, **k: (_ for _ in ()).throw(AssertionError("read again")))
    assert cache.file_digest(a) == hashlib.sha256(data).hexdigest()
    monkeypatch.undo()
    a.write_bytes(data + b"!")
    assert cache.file_digest(a) == hashlib.sha256(data + b"!").hexdigest()
    # A Hugging Face hub file is a link to a blob named by its sha256: no need to read it.
    sha = "ab" * 32
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / sha).write_bytes(b"not what the name says")
    (tmp_path / "snap").mkdir()
    (tmp_path / "snap" / "model.safetensors").symlink_to(tmp_path / "blobs" / sha)
    assert cache.file_digest(tmp_path / "snap" / "model.safetensors") == sha
