"""Timings taken while the machine was busy are measured again, and if they stay noisy they
are used for the run but never cached (a loaded demo once cached k=4 for good; unloaded, the
bench chose 7). The clock and the samples are injected: nothing here sleeps."""

import json
import random

import pytest
from test_policy_cache import TABLE, _engine

from quickdraft.cli import main
from quickdraft.policy import batch_policy, timing
from quickdraft.policy.autok import cached_k
from quickdraft.policy.batch_policy import BatchPolicy
from quickdraft.policy.timing import least_noisy, relative_spread


class FakeClock:
    """A clock whose intervals are steady (1 ms) or, while ``noisy``, anything from 1 to 5 ms."""

    def __init__(self, noisy: bool = True) -> None:
        self.t, self.noisy, self.rng = 0.0, noisy, random.Random(0)

    def __call__(self) -> float:
        self.t += 1e-3 * (self.rng.uniform(1.0, 5.0) if self.noisy else 1.0)
        return self.t


@pytest.fixture
def noise_limit(monkeypatch, tmp_path):
    """The real limit (the test session caches noisy timings) and a private cache."""
    monkeypatch.setenv("QUICKDRAFT_NOISE_LIMIT", str(timing.NOISE_LIMIT))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "quickdraft" / "autok"


def test_relative_spread_is_iqr_over_median():
    assert relative_spread([1.0, 1.0, 1.0, 1.0]) == 0.0
    assert relative_spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx((4 - 2) / 3)
    assert relative_spread([5.0]) == 0.0


def test_noisy_samples_are_measured_again_until_quiet():
    spreads = iter([0.9, 0.6, 0.05])
    logged = []
    result, noise = least_noisy(lambda: ((s := next(spreads)), s), attempts=3, limit=0.25, log=logged.append)
    assert result == 0.05 and noise.attempts == 3 and not noise.noisy
    assert len(logged) == 2 and all("measuring again" in line for line in logged)
    # Quiet at once: one attempt.
    result, noise = least_noisy(lambda: ("quiet", 0.01), attempts=3, limit=0.25)
    assert (result, noise.attempts, noise.noisy) == ("quiet", 1, False)


def test_still_noisy_after_every_attempt_keeps_the_least_noisy():
    spreads = iter([0.9, 0.4, 0.7])
    result, noise = least_noisy(lambda: ((s := next(spreads)), s), attempts=3, limit=0.25)
    assert result == 0.4 and noise.noisy and noise.attempts == 3
    assert "40%" in noise.describe() and "25%" in noise.describe()


def test_a_k_measured_noisy_then_quiet_is_cached(models, noise_limit, monkeypatch):
    tok, target, drafts = models
    clock = FakeClock(noisy=True)
    monkeypatch.setattr(timing, "clock", clock)
    logged = []

    def log(line):
        logged.append(line)
        if "measuring again" in line:
            clock.noisy = False  # the machine calms down

    choice = cached_k(target, drafts["perturbed"], tok, log=log)
    assert sum("measuring again" in line for line in logged) == 1
    assert choice.noise.attempts == 2 and not choice.noise.noisy
    assert choice.path is not None and choice.path.is_file()
    assert not cached_k(target, drafts["perturbed"], tok).measured


def test_a_k_measured_noisy_every_time_is_used_but_not_cached(models, noise_limit, monkeypatch):
    tok, target, drafts = models
    monkeypatch.setattr(timing, "clock", FakeClock(noisy=True))
    logged = []
    choice = cached_k(target, drafts["perturbed"], tok, log=logged.append)
    assert choice.measured and choice.path is None and choice.noise.noisy
    assert choice.noise.attempts == timing.ATTEMPTS
    assert any(line.startswith(f"not caching k={choice.k}") for line in logged)
    assert not list(noise_limit.glob("*.json"))
    # The next run measures again, and caches once the timings are quiet.
    monkeypatch.setattr(timing, "clock", FakeClock(noisy=False))
    again = cached_k(target, drafts["perturbed"], tok)
    assert again.measured and again.path is not None and not again.noise.noisy


def test_the_cli_says_on_stderr_that_a_noisy_k_is_not_cached(tiny_family, noise_limit, monkeypatch, capsys):
    monkeypatch.setattr(timing, "clock", FakeClock(noisy=True))
    run = ["generate", "--model", str(tiny_family["target"]), "--draft", str(tiny_family["perturbed"]),
           "--prompt", "def add(a, b):", "--max-new-tokens", "6", "--json"]
    assert main(run) == 0
    captured = capsys.readouterr()
    assert "measuring again" in captured.err and "not caching k=" in captured.err
    assert json.loads(captured.out)["token_ids"]  # the run itself went on
    assert not list(noise_limit.glob("*.json"))


def test_the_batch_policy_does_not_cache_noisy_costs(models, noise_limit, monkeypatch):
    tok, target, drafts = models
    spreads = [0.9, 0.8, 0.7]
    monkeypatch.setattr(batch_policy, "measure_batch_costs",
                        lambda *a, **k: {**json.loads(json.dumps(TABLE)), "spread": spreads.pop(0)})
    logged = []
    policy = BatchPolicy.for_engine(_engine(target), log=logged.append)
    assert policy.costs(1).t_ar == 1.0 and not spreads  # measured three times, then used
    assert any("not caching the batch policy" in line for line in logged)
    assert not list(noise_limit.glob("batch-*.json"))
    spreads[:] = [0.9, 0.1]  # noisy, then quiet: cached
    BatchPolicy.for_engine(_engine(target), log=logged.append)
    assert not spreads and list(noise_limit.glob("batch-*.json"))


def test_one_hiccup_is_not_a_busy_machine():
    quiet, hiccup = [1.0, 1.01, 0.99, 1.0, 1.02], [1.0, 1.01, 3.0, 2.5, 1.0]
    assert timing.spread_of([quiet] * 7 + [hiccup]) < 0.05  # one timing of eight disturbed
    assert timing.spread_of([quiet] * 5 + [hiccup] * 3) > 0.25  # a busy machine disturbs many
    assert timing.spread_of([]) == 0.0
