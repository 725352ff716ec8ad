"""The benchmark harness end to end on tiny models, its input checks, and the lossless check."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from quickdraft.bench.cli import add_bench_parser
from quickdraft.bench.config import BENCH_METHODS, BenchConfig, BenchError, register_method
from quickdraft.bench.context import load_context
from quickdraft.bench.methods import EngineMethod
from quickdraft.bench.prompt_sets import KINDS
from quickdraft.bench.prompts import (
    BenchPrompt,
    PromptFileError,
    builtin_prompts,
    category_file,
    load_prompts,
    quick_subset,
    save_prompts,
)
from quickdraft.bench.runner import run_benchmark
from quickdraft.decoding.verify import Verdict
from quickdraft.policy import autok

PROMPTS = [
    BenchPrompt("a", "def add(a, b):\n", "function-body"),
    BenchPrompt("b", "for i in range(10):\n    print(i", "repetitive"),
]


def parse(argv):
    parser = argparse.ArgumentParser(prog="quickdraft")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


@pytest.fixture(scope="module")
def ctx(tiny_family):
    return load_context(BenchConfig(model=str(tiny_family["target"]), draft=str(tiny_family["perturbed"])))


def test_cli_end_to_end(tiny_family, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    save_prompts(PROMPTS, prompts)
    args = parse([
        "--model", str(tiny_family["target"]), "--draft", str(tiny_family["perturbed"]),
        "--prompts", str(prompts), "--max-new-tokens", "10", "--repeats", "2", "-k", "3",
        "--sweep", "1,3", "--json", str(tmp_path / "out.json"), "--plot", str(tmp_path / "plots"),
        "--quiet",
    ])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "speedup" in out and "hf-assisted" in out
    # measurements with their spread, no internal goals
    assert "goal" not in out.lower() and "NOT met" not in out and "[min-max]" in out
    result = json.loads((tmp_path / "out.json").read_text())
    assert set(result) >= {"machine", "config", "results", "overall"}
    assert [g["category"] for g in result["results"]] == ["custom"]  # the file names no category
    rows = {r["label"]: r for r in result["overall"]["rows"]}
    group = {r["label"]: r for r in result["results"][0]["rows"]}
    assert set(group) == set(rows) and group["ar"]["predicted_speedup"] == 1.0
    assert set(rows) == {"ar", "draft k=3", "draft k=1", "hf-ar", "hf-assisted k=3"}
    for r in result["results"][0]["rows"]:
        for key in ("method", "settings", "tokens_per_second", "speedup", "mean_accepted_tokens",
                    "acceptance_rate", "per_position_acceptance", "lossless", "step_costs",
                    "predicted_speedup", "efficiency"):
            assert key in r
        assert r["lossless"] is True, r["label"]  # transformers rows are compared too
        for key in ("tokens_per_second", "speedup", "e2e_speedup", "mean_accepted_tokens"):
            spread = r["spread"][key]
            assert spread["n"] == 4  # 2 prompts x 2 repeats
            assert spread["min"] <= spread["q1"] <= spread["median"] <= spread["q3"] <= spread["max"]
        assert r["spread"]["tokens_per_second"]["median"] == pytest.approx(r["tokens_per_second"])
        assert r["spread"]["speedup"]["median"] == pytest.approx(r["speedup"])
        assert r["tokens_per_second"] > 0
    assert rows["ar"]["speedup"] == pytest.approx(1.0)
    assert rows["ar"]["mean_accepted_tokens"] == pytest.approx(1.0)
    assert len(rows["draft k=3"]["per_position_acceptance"]) == 3
    draft = group["draft k=3"]
    assert draft["mean_accepted_tokens"] >= 1.0 and draft["predicted_speedup"] > 0
    assert draft["efficiency"] == pytest.approx(draft["speedup"] / draft["predicted_speedup"])
    assert draft["step_costs"]["t_draft"] > 0 and draft["step_costs"]["t_verify"] > 0
    assert rows["hf-assisted k=3"]["mean_accepted_tokens"] >= 1.0
    assert result["config"]["k"] == 3 and [p["kind"] for p in result["config"]["prompts"]] == [
        "function-body", "repetitive"]
    for name in ("speedup_vs_k.png", "per_position_acceptance.png", "tokens_per_second.png", "report.md"):
        assert (tmp_path / "plots" / name).stat().st_size > 0
    report = (tmp_path / "plots" / "report.md").read_text()
    assert "| method |" in report and "[min-max]" in report and "goal" not in report.lower()


class AcceptEverything:
    """A deliberately lossy acceptance rule: keeps every proposal."""

    def __call__(self, proposal, target_logits):
        k = proposal.size
        return Verdict(list(range(k)), int(target_logits[k].argmax()))


def test_lossy_method_is_caught(ctx, tiny_family, monkeypatch, capsys):
    from quickdraft.drafters import DraftModelDrafter
    from quickdraft.models.lm import load_model

    unrelated = load_model(tiny_family["unrelated"])
    monkeypatch.setattr("quickdraft.bench.config.BENCH_METHODS", dict(BENCH_METHODS))
    register_method("lossy", lambda c, cfg, k: [EngineMethod(
        "lossy", lambda c: DraftModelDrafter(unrelated, c.target.vocab_size), k,
        acceptance=lambda params: AcceptEverything())])
    config = BenchConfig(methods=("ar", "draft", "lossy"), max_new_tokens=12, repeats=1, k=4, threads=None)
    result = run_benchmark(ctx, PROMPTS, config)
    rows = {r["method"]: r for r in result["overall"]["rows"]}
    assert rows["draft"]["lossless"] is True
    assert rows["lossy"]["lossless"] is False
    assert rows["lossy"]["mismatches"] and any("lossy" in line for line in result["mismatches"])


def test_first_mismatch():
    from quickdraft.bench.results import first_mismatch

    assert first_mismatch([1, 2, 3], [1, 2, 4]) == 2
    assert first_mismatch([1, 2], [1, 2, 3]) == 2  # one stopped early (EOS)
    assert first_mismatch([], [5]) == 0


def test_sampled_mode_reports_null_lossless(ctx):
    config = BenchConfig(methods=("ar", "draft"), max_new_tokens=8, repeats=1, k=2, temperature=0.8,
                         seed=3, threads=None)
    result = run_benchmark(ctx, PROMPTS[:1], config)
    assert all(r["lossless"] is None for r in result["overall"]["rows"])


def test_auto_k(ctx):
    ids = torch.tensor(ctx.tokenizer("def add(a, b):\n")["input_ids"])
    k = autok.auto_k(ctx.target, ctx.draft, ctx.tokenizer, ids, max_k=6, calibration_tokens=16)
    assert isinstance(k, int) and 1 <= k <= 6
    res = autok.calibrate(ctx.target, ctx.draft, ctx.tokenizer, ids, probe_k=4, max_k=6, calibration_tokens=16)
    assert set(res.predicted) == set(range(1, 7)) and res.k == max(res.predicted, key=res.predicted.get)
    assert res.costs.t_ar > 0 and res.costs.t_draft > 0 and 5 in res.costs.verify
    assert set(res.costs.draft_burst) == set(range(1, 7))  # j consecutive draft steps after a target pass
    pooled = autok.calibrate(ctx.target, ctx.draft, ctx.tokenizer, [ids, ids[:3]], probe_k=3, max_k=4,
                             calibration_tokens=8)
    assert pooled.calibration_stats.target_forward_passes > res.calibration_stats.target_forward_passes / 4
    assert 1 <= pooled.k <= 4 and len(pooled.per_position) == 3


@pytest.mark.parametrize("argv, message", [
    (["--prompts", "/nonexistent/p.jsonl"], "not found"),
    (["--methods", "ar,nope"], "unknown method"),
    (["--repeats", "0"], "--repeats"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--sweep", "a-b"], "--sweep"),
    # outputs the bench could not write: refused before minutes of measurements, not after
    (["--json", "/proc/no/x.json"], "--json /proc/no/x.json: cannot"),
    (["--json", "/proc/x.json"], "--json /proc/x.json: cannot write there"),
    (["--markdown", "/"], "is a directory"),
    (["--plot", "/proc/plots"], "--plot /proc/plots: cannot"),
    (["--methods", "ar", "--batch-size", "1"], "add one of draft, ngram"),
])
def test_bad_input_exits_2(argv, message, capsys):
    args = parse(argv)
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_malformed_jsonl(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "prompt": "ok"}\n{"id": "y", "prompt": \n')
    args = parse(["--prompts", str(bad)])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2" in err and len(err.strip().splitlines()) == 1
    for text, msg in [('{"prompt": "p"}', "'id'"), ('{"id": "a", "prompt": ""}', "'prompt'"),
                      ('[1, 2]', "JSON object"), ('', "no prompts"),
                      ('{"id": "a", "prompt": "p"}\n{"id": "a", "prompt": "q"}', "duplicate")]:
        bad.write_text(text)
        with pytest.raises(PromptFileError, match=msg):
            load_prompts(bad)


def test_missing_draft_is_a_clean_error(tiny_family, capsys):
    args = parse(["--model", str(tiny_family["target"]), "--methods", "ar,draft", "--quiet"])
    assert args.func(args) == 2
    assert "draft" in capsys.readouterr().err


def test_bench_error_for_unknown_method(ctx):
    with pytest.raises(BenchError, match="unknown method"):
        run_benchmark(ctx, PROMPTS, BenchConfig(methods=("ar", "zzz"), threads=None))


def test_short_category_is_the_former_default_set():
    assert category_file("short").is_file()
    prompts = builtin_prompts(("short",))
    assert len(prompts) >= 9 and len({p.id for p in prompts}) == len(prompts)
    assert {p.kind for p in prompts} == set(KINDS) and {p.category for p in prompts} == {"short"}
    assert all(p.source and len(p.prompt) <= 450 for p in prompts)
    quick = builtin_prompts(("short",), per_category=3)
    assert len(quick) == 3 and {p.kind for p in quick} == set(KINDS)
    assert quick_subset(prompts, 2) == prompts[:2]


def test_a_run_that_ends_at_once_has_no_tokens_per_second():
    """A prompt whose first token is EOS yields 0 tokens: no rate, not '0.0 tok/s' in the spread."""
    from quickdraft.bench.methods import EngineMethod
    from quickdraft.bench.results import RunOutput, summarise

    ar = EngineMethod("ar", None)
    runs = {ar.label: [[RunOutput(list(range(100)), 1.0, 1.2)], [RunOutput([], 1e-5, 0.3)]]}
    (row,), _ = summarise([ar], runs, ["p1", "p2"], None, 4, greedy=True)
    assert row["tokens_per_second"] == 100.0
    assert row["spread"]["tokens_per_second"]["min"] == 100.0
    assert row["spread"]["tokens_per_second"]["n"] == 1
