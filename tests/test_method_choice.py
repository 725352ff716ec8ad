"""``--method auto``: the replay of greedy decoding the cost model uses is exact (as many
steps as the engine's target passes, for every kind of candidate), the choice is the best
prediction, it is cached, and generating with it is lossless."""

import json

import pytest
import torch

from quickdraft.cli import main
from quickdraft.decoding.engine import decode
from quickdraft.decoding.stats import GenerationStats
from quickdraft.decoding.stopping import StopConditions
from quickdraft.models.lm import eos_token_ids
from quickdraft.policy.cost_model import StepCosts
from quickdraft.policy.method_choice import (
    Candidate,
    Trace,
    cached_method,
    choose_method,
    record_trace,
    replay,
    replay_speedup,
)

CANDIDATES = [Candidate("draft", 1), Candidate("draft", 3), Candidate("draft", 6),
              Candidate("tree", 3, (2, 1, 1)), Candidate("tree", 3, (3, 2, 1)), Candidate("tree", 2, (2, 2)),
              Candidate("ngram", 4), Candidate("ngram", 2), Candidate("hybrid", 5), Candidate("hybrid", 2)]
PROMPTS = ["def add(a, b):", "class Point:\n    def", "for i in range(10):\n    print(i"]


def engine_passes(candidate, target, draft, ids, n, eos):
    from quickdraft.policy.method_choice import MethodChoice
    from quickdraft.resolve import MethodPlan

    choice = MethodChoice(candidate.method, candidate.k, candidate.tree, 1.0)
    stats = GenerationStats()
    drafter = MethodPlan(choice.method, choice.options(), choice).drafter(draft, target)
    out = [t for s in decode(target, ids, StopConditions(n, eos), drafter,
                             num_speculative_tokens=candidate.k, stats=stats) for t in s.tokens]
    return out, stats.target_forward_passes


@pytest.mark.parametrize("draft_name", ["perturbed", "unrelated"])
def test_replay_takes_exactly_the_engines_steps(models, draft_name):
    tok, target, drafts = models
    eos = eos_token_ids(target, tok)
    for prompt in PROMPTS:
        ids = torch.tensor(tok(prompt)["input_ids"])
        trace = record_trace(target, drafts[draft_name], ids, 40, eos)
        for candidate in CANDIDATES:
            out, passes = engine_passes(candidate, target, drafts[draft_name], ids, 40, eos)
            assert out == trace.output  # lossless, and the reference the replay walks
            assert len(replay(candidate, trace)) == passes, (prompt, candidate)


def test_replay_of_a_copy_draft_accepts_everything(models):
    tok, target, drafts = models
    ids = torch.tensor(tok(PROMPTS[0])["input_ids"])
    trace = record_trace(target, drafts["copy"], ids, 30, [])
    assert set(trace.ranks) == {0}
    assert len(replay(Candidate("draft", 4), trace)) == 6  # 30 tokens, 5 a step


def test_predicted_speedup_weighs_acceptance_against_costs():
    trace = Trace(prompt=[1, 2, 3], output=list(range(10, 40)), ranks=[0] * 30)
    cheap = StepCosts(t_ar=1.0, t_draft=0.01, verify={n: 1.0 + 0.05 * (n - 1) for n in range(1, 20)})
    dear = StepCosts(t_ar=1.0, t_draft=1.0, verify={n: 1.0 + 0.05 * (n - 1) for n in range(1, 20)})
    fast, tau = replay_speedup(Candidate("draft", 4), [trace], cheap)
    assert tau == 5.0 and fast == pytest.approx(30 / (6 * (0.04 + 1.2)))
    slow, _ = replay_speedup(Candidate("draft", 4), [trace], dear)
    assert slow < 1.0 < fast
    # No n-gram match in a sequence without repeats: plain steps, exactly plain decoding's cost.
    assert replay_speedup(Candidate("ngram", 4), [trace], cheap) == (pytest.approx(1.0), 1.0)


def test_choice_is_the_best_prediction_and_is_cached(models, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    tok, target, drafts = models
    choice = choose_method(target, drafts["copy"], tok, prompts=PROMPTS[:2], new_tokens=24)
    assert choice.predicted == max(s for s, _ in choice.table.values())
    assert choice.table[choice.label if choice.method != "ar" else "ar"][0] == choice.predicted
    logged = []
    first = cached_method(target, drafts["copy"], tok, log=logged.append)
    again = cached_method(target, drafts["copy"], tok, log=logged.append)
    assert len(logged) == 1 and first.measured and not again.measured
    assert (again.method, again.k, again.tree) == (first.method, first.k, first.tree)
    assert again.free_costs.verify == first.free_costs.verify != first.costs.verify  # both regimes cached
    assert json.loads(first.path.read_text())["method"] == first.method


def test_each_candidate_is_priced_in_the_regime_it_decodes_in(models):
    """The draft model's candidates are priced with verify passes timed after a draft
    burst, prompt lookup with passes timed after plain steps (it never runs the draft)."""
    tok, target, drafts = models
    draft = drafts["perturbed"]
    choice = choose_method(target, draft, tok, prompts=PROMPTS, new_tokens=32, max_k=4)
    assert choice.costs.draft_burst and not choice.free_costs.draft_burst
    eos = eos_token_ids(target, tok)
    traces = [record_trace(target, draft, torch.tensor(tok(p)["input_ids"]), 32, eos) for p in PROMPTS]
    told_apart = False
    for candidate in [c for c in CANDIDATES if c.label in choice.table]:
        own, other = ((choice.free_costs, choice.costs) if candidate.method == "ngram"
                      else (choice.costs, choice.free_costs))
        assert choice.table[candidate.label] == pytest.approx(replay_speedup(candidate, traces, own)), candidate
        told_apart |= replay_speedup(candidate, traces, own) != pytest.approx(replay_speedup(candidate, traces, other))
    assert told_apart  # the regimes' prices differ, so the check above could fail


def test_cli_auto_is_lossless_and_says_what_it_chose(tiny_family, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    common = ["generate", "--model", str(tiny_family["target"]), "--draft", str(tiny_family["perturbed"]),
              "--prompt", "def add(a, b):", "--max-new-tokens", "24", "--json"]
    assert main([*common, "--method", "ar"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*common, "--method", "auto"]) == 0
    captured = capsys.readouterr()
    auto = json.loads(captured.out)
    assert auto["token_ids"] == plain["token_ids"]
    assert "auto chose" in captured.err and auto["settings"]["method"].startswith("auto: ")


def test_auto_weighs_no_token_tree_on_the_transformers_backend(tiny_family, tmp_path, monkeypatch):
    """The transformers backend verifies chains only: auto must not pick (or weigh) a tree there."""
    from quickdraft.generator import SpeculativeGenerator
    from quickdraft.models.lm import load_model
    from quickdraft.pair import load_tokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    tok = load_tokenizer(tiny_family["target"])
    target, draft = load_model(tiny_family["target"], "hf"), load_model(tiny_family["copy"], "hf")
    choice = choose_method(target, draft, tok, prompts=PROMPTS[:1], new_tokens=16, max_k=4)
    assert choice.table and not [label for label in choice.table if label.startswith("tree")]
    assert {label.split()[0] for label in choice.table} >= {"draft", "hybrid", "ngram"}
    gen = SpeculativeGenerator.for_pair(target, draft, tok, "auto")
    assert gen.plan.method != "tree" and gen.plan.choice is not None


@pytest.mark.slow
def test_server_auto_resolves_as_generate_does(tiny_family, tmp_path):
    """`serve --method auto` goes through the same resolution as `generate --method auto`
    (one cache entry, the same choice and k), and its greedy output is plain decoding's."""
    import os
    import subprocess
    import sys

    from serving import ServerProcess

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    common = ["--model", str(tiny_family["target"]), "--draft", str(tiny_family["perturbed"])]
    generate = [sys.executable, "-m", "quickdraft", "generate", *common, "--prompt", "def add(a, b):",
                "--max-new-tokens", "16", "--json"]
    plain = json.loads(subprocess.run([*generate, "--method", "ar"], env=env, capture_output=True, text=True,
                                      check=True).stdout)
    auto = json.loads(subprocess.run([*generate, "--method", "auto"], env=env, capture_output=True, text=True,
                                     check=True).stdout)["settings"]
    srv = ServerProcess([*common, "--method", "auto", "--max-batch-size", "2", "--served-model-name", "m"], tmp_path / "serve.log", env=env)
    try:
        health = srv.health()
        assert health["method"] == auto["method"] and health["num_speculative_tokens"] == auto["num_speculative_tokens"]
        assert "measuring which method" not in srv.log.read_text()  # the choice generate cached
        status, body = srv.post("/v1/completions", {"model": "m", "prompt": "def add(a, b):", "max_tokens": 16,
                                                    "temperature": 0})
        assert status == 200 and body["choices"][0]["text"] == plain["text"]
    finally:
        srv.stop()
    assert len(list((tmp_path / "cache").rglob("method-*.json"))) == 1


def test_serve_auto_for_is_checked_before_loading(capsys):
    assert main(["serve", "--method", "draft", "--auto-for", "chat"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--auto-for goes with --method auto" in err
