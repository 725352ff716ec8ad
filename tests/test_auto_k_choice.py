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


# --- a draft predicted to lose is not used -----------------------------------------------------


def test_a_draft_predicted_to_lose_is_not_used_and_the_line_says_how_to_force_it(tiny_family, measured, capsys):
    measured.clear()
    measured.update({1: 0.77, 2: 0.61, 3: 0.5, 4: 0.42})
    assert main(run_args(tiny_family, "--method", "ar")) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(run_args(tiny_family)) == 0
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if "without the draft" in line]
    assert lines == ["quickdraft: decoding without the draft: the cost model predicts it slower than plain "
                     "decoding (best k=1: 0.77x; measured now); -k N uses it anyway"]
    out = json.loads(captured.out)
    assert out["settings"]["num_speculative_tokens"] == 0
    assert out["stats"]["drafted_tokens"] == 0 and out["token_ids"] == plain["token_ids"]
    # Cached: the same decision, and the line says where it came from.
    assert main(run_args(tiny_family)) == 0
    captured = capsys.readouterr()
    assert "without the draft" in captured.err and "cached measurement from" in captured.err
    assert json.loads(captured.out)["stats"]["drafted_tokens"] == 0
    # -k forces the draft.
    assert main(run_args(tiny_family, "-k", "2")) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["drafted_tokens"] > 0


def test_k_zero_decodes_plainly(tiny_family):
    from quickdraft import SpeculativeGenerator

    gen = SpeculativeGenerator.from_pretrained(tiny_family["target"], tiny_family["perturbed"])
    drafted = gen.generate("def add(a, b):", max_new_tokens=12, num_speculative_tokens=3)
    plain = gen.generate("def add(a, b):", max_new_tokens=12, num_speculative_tokens=0)
    assert plain.token_ids == drafted.token_ids
    assert plain.stats.drafted_tokens == 0 and drafted.stats.drafted_tokens > 0


def test_tuning_sets_k_zero_when_the_draft_loses(tiny_family, measured):
    from quickdraft import SpeculativeGenerator

    measured.clear()
    measured.update({1: 0.99, 2: 0.9})
    gen = SpeculativeGenerator.from_pretrained(tiny_family["target"], tiny_family["perturbed"])
    choice = gen.tune_num_speculative_tokens()
    assert choice.k == 0 and choice.best_k == 1 and gen.num_speculative_tokens == 0
    assert json.loads(choice.path.read_text())["k"] == 0
    assert gen.generate("def add(a, b):", max_new_tokens=8).stats.drafted_tokens == 0
