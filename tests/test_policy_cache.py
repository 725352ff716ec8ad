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
