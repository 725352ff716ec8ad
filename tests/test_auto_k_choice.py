"""What `quickdraft generate` says on stderr about the k the cost model chose: measured now
or read from the cache (and when it was measured, and how to measure again)."""

import json
import time

import pytest

from quickdraft.cli import main
from quickdraft.policy import autok, method_choice
from quickdraft.policy.autok import AutoKResult
from quickdraft.policy.cost_model import StepCosts
from quickdraft.policy.method_choice import MethodChoice, cached_method

COSTS = StepCosts(t_ar=1.0, t_draft=0.1, verify={n: 1.0 + 0.1 * n for n in range(1, 10)})


def run_args(tiny_family, *extra):
    return ["generate", "--model", str(tiny_family["target"]), "--draft", str(tiny_family["perturbed"]),
            "--prompt", "def add(a, b):", "--max-new-tokens", "6", "--json", *extra]


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """A private cache and a calibration that predicts ``curve`` (speedup per k) at once."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    curve = {1: 1.5, 2: 1.8, 3: 2.0, 4: 1.9}

    def calibrate(*args, **kwargs):
        best = max(curve, key=lambda k: (curve[k], -k))
        return AutoKResult(best, COSTS, [0.9, 0.8, 0.7, 0.6], dict(curve))

    monkeypatch.setattr(autok, "calibrate", calibrate)
    return curve


def test_the_line_says_a_cached_k_is_cached_and_when_it_was_measured(tiny_family, measured, capsys):
    assert main(run_args(tiny_family)) == 0
    first = capsys.readouterr()
    assert "k=3 (cost model: predicted 2.00x over plain decoding; measured now)" in first.err
    assert main(run_args(tiny_family)) == 0
    again = capsys.readouterr()
    today = time.strftime("%Y-%m-%d", time.gmtime())
    assert (f"k=3 (cost model: predicted 2.00x over plain decoding; cached measurement from {today}, "
            "re-measure with --remeasure)") in again.err
    assert json.loads(again.out)["settings"]["num_speculative_tokens_source"] == "cost model, cached"


def test_auto_says_its_choice_was_cached(models, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(method_choice, "choose_method", lambda *a, **k: MethodChoice(
        "draft", 3, (), 2.0, {"draft k=3": (2.0, 3.0), "ngram k=2": (1.2, 1.5), "ar": (1.0, 1.0)}, COSTS))
    tok, target, drafts = models
    assert cached_method(target, drafts["perturbed"], tok).summary().endswith("; measured now)")
    cached = cached_method(target, drafts["perturbed"], tok)
    today = time.strftime("%Y-%m-%d", time.gmtime())
    assert cached.summary() == ("auto chose draft k=3 (predicted 2.00x; best of the others: ngram k=2 1.20x, ar 1.00x; "
                                f"cached measurement from {today}, re-measure with --remeasure)")
