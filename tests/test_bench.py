"""The benchmark harness end to end on tiny models, its input checks, and the lossless check."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from quickdraft.bench import autok
from quickdraft.bench.cli import add_bench_parser
from quickdraft.bench.prompts import (
    DEFAULT_PROMPTS_FILE,
    KINDS,
    BenchPrompt,
    PromptFileError,
    build_default_prompts,
    default_prompts,
    load_prompts,
    quick_subset,
    save_prompts,
)
from quickdraft.bench.runner import (
    METHODS,
    BenchConfig,
    BenchError,
    EngineMethod,
    load_context,
    run_benchmark,
)
from quickdraft.verify import Verdict

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
    return load_context(str(tiny_family["target"]), str(tiny_family["perturbed"]), need_draft=True)


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
    result = json.loads((tmp_path / "out.json").read_text())
    assert set(result) >= {"machine", "config", "results"}
    rows = {r["label"]: r for r in result["results"]}
    assert set(rows) == {"ar", "draft k=3", "draft k=1", "hf-ar", "hf-assisted k=3"}
    for r in result["results"]:
        for key in ("method", "settings", "tokens_per_second", "speedup", "mean_accepted_tokens",
                    "acceptance_rate", "per_position_acceptance", "lossless", "step_costs",
                    "predicted_speedup", "efficiency"):
            assert key in r
        assert r["lossless"] is True, r["label"]  # transformers rows are compared too
        assert r["tokens_per_second"] > 0
    assert rows["ar"]["speedup"] == pytest.approx(1.0)
    assert rows["ar"]["mean_accepted_tokens"] == pytest.approx(1.0)
    draft = rows["draft k=3"]
    assert len(draft["per_position_acceptance"]) == 3
    assert draft["mean_accepted_tokens"] >= 1.0 and draft["predicted_speedup"] > 0
    assert draft["efficiency"] == pytest.approx(draft["speedup"] / draft["predicted_speedup"])
    assert draft["step_costs"]["t_draft"] > 0 and draft["step_costs"]["t_verify"] > 0
    assert rows["hf-assisted k=3"]["mean_accepted_tokens"] >= 1.0
    assert result["config"]["k"] == 3 and [p["kind"] for p in result["config"]["prompts"]] == [
        "function-body", "repetitive"]
    for name in ("speedup_vs_k.png", "per_position_acceptance.png", "tokens_per_second.png", "report.md"):
        assert (tmp_path / "plots" / name).stat().st_size > 0
    assert "| method |" in (tmp_path / "plots" / "report.md").read_text()


class AcceptEverything:
    """A deliberately lossy acceptance rule: keeps every proposal."""

    def __call__(self, proposal, target_logits):
        k = proposal.size
        return Verdict(list(range(k)), int(target_logits[k].argmax()))


def test_lossy_method_is_caught(ctx, tiny_family, monkeypatch, capsys):
    from quickdraft.drafters import DraftModelDrafter
    from quickdraft.models.lm import load_model

    unrelated = load_model(tiny_family["unrelated"])
    monkeypatch.setitem(METHODS, "lossy", lambda c, cfg, k: [EngineMethod(
        "lossy", lambda c: DraftModelDrafter(unrelated, c.target.vocab_size), k,
        acceptance=lambda params: AcceptEverything())])
    config = BenchConfig(methods=("ar", "draft", "lossy"), max_new_tokens=12, repeats=1, k=4, threads=None)
    result = run_benchmark(ctx, PROMPTS, config)
    rows = {r["method"]: r for r in result["results"]}
    assert rows["draft"]["lossless"] is True
    assert rows["lossy"]["lossless"] is False
    assert rows["lossy"]["mismatches"] and any("lossy" in line for line in result["mismatches"])


def test_first_mismatch():
    from quickdraft.bench.runner import _first_mismatch

    assert _first_mismatch([1, 2, 3], [1, 2, 4]) == 2
    assert _first_mismatch([1, 2], [1, 2, 3]) == 2  # one stopped early (EOS)
    assert _first_mismatch([], [5]) == 0


def test_sampled_mode_reports_null_lossless(ctx):
    config = BenchConfig(methods=("ar", "draft"), max_new_tokens=8, repeats=1, k=2, temperature=0.8,
                         seed=3, threads=None)
    result = run_benchmark(ctx, PROMPTS[:1], config)
    assert all(r["lossless"] is None for r in result["results"])


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


def test_default_prompt_set():
    assert DEFAULT_PROMPTS_FILE.is_file()
    prompts = default_prompts()
    assert len(prompts) >= 9 and len({p.id for p in prompts}) == len(prompts)
    assert {p.kind for p in prompts} == set(KINDS)
    assert all(p.source and len(p.prompt) <= 450 for p in prompts)
    quick = default_prompts(quick=True)
    assert len(quick) == 4 and {p.kind for p in quick} == set(KINDS)
    assert quick_subset(prompts, 2) == prompts[:2]


def test_build_default_prompts_is_deterministic(tmp_path):
    body = "".join(
        f"def f{i}(x, y):\n    \"\"\"Add x and y ({i}).\"\"\"\n    z = x + y\n    z += {i}\n    w = z * 2\n    return w\n\n"
        for i in range(3)
    )
    table = "TABLE = {\n" + "".join(f"    'k{i}': {i},\n" for i in range(12)) + "}\n"
    for n in range(3):
        (tmp_path / f"mod{n}.py").write_text(body + table)
    a, b = build_default_prompts(tmp_path), build_default_prompts(tmp_path)
    assert a == b and {p.kind for p in a} == set(KINDS)
    doc = next(p for p in a if p.kind == "docstring")
    assert doc.prompt.endswith('"""')
    fb = next(p for p in a if p.kind == "function-body")
    assert fb.prompt.rstrip().endswith('"""') and "def f" in fb.prompt
