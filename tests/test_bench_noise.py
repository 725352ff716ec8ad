"""`quickdraft bench` under load printed `overhead -440.88 ms` and `predicted 31.69x`: figures
that timing noise made meaningless are flagged as too noisy to trust, not printed as numbers."""

import io

import pytest

from quickdraft.bench import runner
from quickdraft.bench.config import BenchConfig
from quickdraft.bench.context import load_context
from quickdraft.bench.prompts import BenchPrompt
from quickdraft.bench.report import markdown_report, print_table, summary_lines
from quickdraft.bench.results import TOO_NOISY, too_noisy
from quickdraft.bench.runner import run_benchmark
from quickdraft.policy.autok import AutoKResult, StepCostSampler
from quickdraft.policy.cost_model import StepCosts

PROMPTS = [BenchPrompt("a", "def add(a, b):\n", "function-body"),
           BenchPrompt("b", "for i in range(10):\n    print(i", "repetitive")]


def test_figures_past_their_bounds_are_too_noisy(monkeypatch):
    fine = {"k": 4, "draft_seconds": 0.002, "verify_seconds": 0.004, "measured_step_seconds": 0.007,
            "overhead_seconds": 0.001}
    assert too_noisy(4, 2.1, fine) == {}
    assert set(too_noisy(4, 31.69, fine)) == {"predicted_speedup"}  # above k + 1 = 5
    assert too_noisy(4, 31.69, fine)["predicted_speedup"] == "above its bound k + 1"
    assert too_noisy(4, 4.9, fine) == {}
    negative = {**fine, "overhead_seconds": -0.44088}
    assert too_noisy(4, 2.1, negative) == {"overhead": "negative, over 25% of the step"}
    # A little below zero is the model's error on a quiet machine (sampled calls run a few
    # percent dearer than in the decode loop), not noise.
    assert too_noisy(4, 2.1, {**fine, "overhead_seconds": -0.0004}) == {}
    assert too_noisy(0, 1.0, None) == {}  # ar: predicted 1 by definition
    monkeypatch.setenv("QUICKDRAFT_NOISE_LIMIT", "0.25")
    assert set(too_noisy(4, 2.1, fine, costs_spread=0.9)) == {"predicted_speedup", "overhead"}
    assert too_noisy(4, 2.1, fine, costs_spread=0.05) == {}


class LoadedSampler(StepCostSampler):
    """Step costs as a loaded machine measured them: a 1 s plain step, next to nothing for
    a verify pass (50 ms) or a draft step (the timings of the real runs stay as they are)."""

    def costs(self) -> StepCosts:
        return StepCosts(t_ar=1.0, t_draft=1e-4, verify={n: 1.0 if n == 1 else 0.05 for n in range(1, 12)})


@pytest.fixture(scope="module")
def loaded_result(tiny_family):
    ctx = load_context(BenchConfig(model=str(tiny_family["target"]), draft=str(tiny_family["perturbed"])))
    patch = pytest.MonkeyPatch()
    patch.setattr(runner, "StepCostSampler", LoadedSampler)
    try:
        config = BenchConfig(methods=("ar", "draft"), max_new_tokens=10, repeats=1, k=3, threads=None)
        yield run_benchmark(ctx, PROMPTS, config)
    finally:
        patch.undo()


def test_the_report_says_too_noisy_instead_of_printing_the_numbers(loaded_result):
    group = loaded_result["results"][0]
    draft = next(r for r in group["rows"] if r["label"] == "draft k=3")
    ar = next(r for r in group["rows"] if r["label"] == "ar")
    assert draft["predicted_speedup"] > 4 and draft["too_noisy"].keys() == {"predicted_speedup", "overhead"}
    assert ar["step_breakdown"]["overhead_seconds"] < 0 and ar["too_noisy"].keys() == {"overhead"}
    lines = summary_lines(loaded_result, group)
    step_lines = [line for line in lines if "measured =" in line]
    assert len(step_lines) == 2 and all(line.endswith(f"overhead {TOO_NOISY}") for line in step_lines)
    assert not any("overhead -" in line for line in lines)
    from rich.console import Console

    out = io.StringIO()
    print_table(loaded_result, Console(file=out, width=250))
    text = out.getvalue()
    assert "too noisy" in text and f"{draft['predicted_speedup']:.2f}x" not in text
    report = markdown_report(loaded_result)
    assert "too noisy" in report and f"{draft['predicted_speedup']:.2f}x" not in report
    assert f"{ar['step_breakdown']['overhead_seconds'] * 1e3:.2f}" not in report
    warning = next(w for w in loaded_result["warnings"] if TOO_NOISY in w)
    assert warning.startswith("custom: the overhead of ar, draft k=1") and "(negative, over 25%" in warning
    assert "the predicted speedup of draft k=1" in warning and "(above its bound k + 1)" in warning


def test_the_calibration_line_flags_an_impossible_prediction(monkeypatch):
    ctx = type("Ctx", (), {"target": None, "draft": object(), "tokenizer": None})()
    monkeypatch.setattr(runner, "calibrate", lambda *a, **k: AutoKResult(
        3, StepCosts(1.0, 0.1), [1.0], {1: 1.9, 2: 2.5, 3: 31.69}))
    logged = []
    k, _ = runner._choose_k(ctx, BenchConfig(k=None), [[1, 2, 3]], logged.append)
    assert k == 3 and logged == [f"k = 3 (cost model; its predicted speedup is {TOO_NOISY})"]
    monkeypatch.setattr(runner, "calibrate", lambda *a, **k: AutoKResult(
        3, StepCosts(1.0, 0.1), [1.0], {1: 1.5, 2: 1.8, 3: 2.0}))
    logged.clear()
    runner._choose_k(ctx, BenchConfig(k=None), [[1, 2, 3]], logged.append)
    assert logged == ["k = 3 (cost model, predicted 2.00x)"]
