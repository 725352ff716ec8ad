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

    choice = MethodChoice(candidate.method, candidate.k, candidate.tree, 1.0)
    stats = GenerationStats()
    out = [t for s in decode(target, ids, StopConditions(n, eos), choice.drafter(draft, target.vocab_size),
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
    assert json.loads(first.path.read_text())["method"] == first.method


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
