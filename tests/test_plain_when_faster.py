"""A head method's batched rows decode plainly with several rows where the engine's own
steps measure plain decoding faster (``PlainWhenFaster``): the choice follows measured
tokens per second, a lone row keeps its k, -k keeps k throughout, and every row's greedy
output is plain decoding's whichever kind of step it took."""

from __future__ import annotations

import pytest
import torch

from quickdraft.batch_generate import make_batch_engine
from quickdraft.decoding.sampling import SamplingParams
from quickdraft.decoding.stopping import StopConditions
from quickdraft.generator import SpeculativeGenerator
from quickdraft.policy.batch_policy import LoneRowK, PlainWhenFaster

PROMPTS = ["def add(a, b):\n    return", "import os\n\ndef main():\n    path = os.path.",
           "class Point:\n    def __init__(self, x, y):\n        self."]


def steps(policy: PlainWhenFaster, rows: int, n: int, per_row: float, drafting: float = 2.0, plain: float = 1.0,
          catching_up: float = 10.0, slow: frozenset[int] = frozenset()) -> list[int]:
    """``n`` steps of ``rows`` rows: a drafting one makes ``per_row`` tokens a row in
    ``drafting`` seconds (``catching_up`` times as long after a plain step: the drafters
    feed what they missed), a plain one a token a row in ``plain`` seconds; the steps in
    ``slow`` take ten times as long (a busy machine)."""
    ks: list[int] = []
    for i in range(n):
        k = policy.k(rows)
        seconds = (drafting * (catching_up if ks and not ks[-1] else 1)) if k else plain
        policy.observe(rows, k, round(rows * (per_row if k else 1)), seconds * (10 if i in slow else 1))
        ks.append(k)
    return ks


def zeros(ks: list[int]) -> list[int]:
    return [i for i, k in enumerate(ks) if k == 0]


def test_several_rows_take_the_kind_of_step_that_makes_more_tokens_a_second():
    policy = PlainWhenFaster(3, window=8, explore_every=16, horizon=32)
    assert steps(policy, 1, 20, per_row=1.5) == [3] * 20  # alone: k, unmeasured
    # 1.5 tokens a row for twice a plain step's time: plain, but for two drafting steps in
    # 16 that keep the figures fresh
    ks = steps(policy, 4, 48, per_row=1.5)
    assert ks[:5] == [3, 3, 0, 0, 0] and [i for i, k in enumerate(ks) if k and i >= 5] == [15, 16, 31, 32, 47]
    assert policy.gain(4) == pytest.approx(0.75)
    # The content turns (4 tokens a row): the next explored drafting step brings speculation
    # back (the poorer ones are older than the horizon), and plain steps are the explored ones.
    assert zeros(steps(policy, 4, 64, per_row=4)) == [15, 16, 31, 32, 47, 48, 63]
    # Within 15% of each other the other kind is explored four times as often.
    ks = steps(policy, 4, 64, per_row=2.2)
    assert zeros(ks)[1:] == [j for i in range(11, 64, 4) for j in (i, i + 1) if j < 64]
    # Each number of rows has figures of its own (a step of fewer rows makes fewer tokens
    # a second either way): 3 rows start over.
    assert steps(policy, 3, 8, per_row=4) == [3, 3, 3, 0, 0, 3, 3, 3]


def test_a_busy_machine_or_a_catching_up_step_does_not_turn_the_choice():
    """Times are medians over many steps: a few ten times slower leave the choice alone.
    A drafting step after plain ones is not timed: its drafters catch up on what the plain
    steps decoded, which steady drafting does not pay; timed, ten times slower, it would
    keep speculation off where it pays."""
    policy = PlainWhenFaster(3, window=8, explore_every=16, horizon=32)
    ks = steps(policy, 4, 64, per_row=3, catching_up=10, slow=frozenset({10, 11, 20, 21, 22}))
    assert zeros(ks) == [2, 3, 15, 16, 31, 32, 47, 48, 63]
    assert policy.gain(4) == pytest.approx(1.5)


def test_drafting_outlasts_a_shallow_dip_but_not_a_deep_one():
    """Once drafting, a gain just under 1 (a stretch where drafts fare a little worse) keeps
    it; a gain well under 1 stops it."""
    policy = PlainWhenFaster(3, window=4, explore_every=32, horizon=8)
    assert zeros(steps(policy, 10, 40, per_row=3)) == [2, 3, 31, 32]  # warm-up, then drafting
    # gain 0.95: plain only in the explored steps (two in eight, as it is close to 1)
    assert zeros(steps(policy, 10, 32, per_row=1.9)) == [7, 8, 15, 16, 23, 24, 31]
    assert policy.gain(10) == pytest.approx(0.95)
    assert len(zeros(steps(policy, 10, 32, per_row=1.5))) > 24  # gain 0.75: plain


def test_the_inner_policy_gives_k_and_zero_stays_zero():
    policy = PlainWhenFaster(LoneRowK(6, 2), window=2)
    assert policy.k(1) == 6 and policy.k(3) == 2
    assert PlainWhenFaster(0).k(4) == 0


@pytest.fixture(scope="module")
def eagle():
    return SpeculativeGenerator.from_pretrained(method="eagle")


def decode(engine, prompts: list[torch.Tensor], max_new_tokens: int) -> tuple[list[list[int]], list[int]]:
    out: list[list[int]] = [[] for _ in prompts]
    rows = {engine.add(ids, SamplingParams(), StopConditions(max_new_tokens, [])): i for i, ids in enumerate(prompts)}
    ks = []
    while engine.active:
        for row, update in engine.step().items():
            out[rows[row]].extend(update.tokens)
        ks.append(engine.last_k)
    return out, ks


def test_the_engine_reports_its_steps_and_rows_stay_lossless(eagle):
    """The engine tells the policy each step's rows, k, tokens and time; the policy turns
    speculation on and off between steps and every row is plain decoding's."""
    prompts = [torch.tensor(eagle.tokenizer(p)["input_ids"]) for p in PROMPTS]
    plain = make_batch_engine(eagle.target, "ar", None, max_batch_size=3)
    expected, _ = decode(plain, prompts, 40)
    engine = make_batch_engine(eagle.target, "eagle", None, max_batch_size=3, num_speculative_tokens=2,
                               options=eagle.plan.options, plain_when_faster=True)
    policy = engine.policy
    assert isinstance(policy, PlainWhenFaster) and engine.num_speculative_tokens is None and policy.inner == 2
    reported = []
    observe = policy.observe
    policy.observe = lambda rows, k, tokens, seconds: (reported.append((rows, k, tokens)), observe(rows, k, tokens, seconds))
    out, ks = decode(engine, prompts, 40)
    assert out == expected
    assert 0 in ks and 2 in ks, ks  # both kinds of steps ran
    assert policy.gain(3) is not None
    assert reported and all(k in (0, 2) for _, k, _ in reported)
    assert all(tokens == rows for rows, k, tokens in reported if k == 0)  # a plain step: a token a row
    assert sum(t for _, _, t in reported) < sum(map(len, out))  # the prefill step is not reported


def test_k_given_holds_at_every_step(eagle):
    engine = make_batch_engine(eagle.target, "eagle", None, max_batch_size=3, num_speculative_tokens=2,
                               options=eagle.plan.options)
    assert engine.policy is None and engine.num_speculative_tokens == 2
    prompts = [torch.tensor(eagle.tokenizer(p)["input_ids"]) for p in PROMPTS]
    _, ks = decode(engine, prompts, 24)
    assert set(ks) == {2}
