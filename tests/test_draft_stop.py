"""Draft-stop policies (--draft-stop): their update rules on hand-computed sequences, and
every policy keeps greedy speculative output equal to plain decoding."""

import pytest
import torch

from quickdraft.decoding.engine import decode
from quickdraft.decoding.stats import GenerationStats
from quickdraft.decoding.stopping import StopConditions
from quickdraft.drafters import DraftModelDrafter
from quickdraft.drafters.draft_stop import (
    ConfidenceStop,
    CostStop,
    DraftVerifyStop,
    HeuristicStop,
    parse_draft_stop,
)
from quickdraft.policy.cost_model import StepCosts

PROMPTS = ["def add(a, b):", "x"]
POLICIES = ["fixed", "confidence:0.5", "confidence:0.95", "dv", "dv:start=0.2,max=5", "heuristic", "cost"]


def top1(p: float, vocab: int = 10) -> torch.Tensor:
    """A distribution whose largest probability is ``p``."""
    q = torch.full((vocab,), (1 - p) / (vocab - 1))
    q[3] = p
    return q


def test_dv_reproduces_the_papers_update_rule():
    """Draft & Verify's rule with the paper's defaults (b1 0.5, AR_target 0.9, eps 0.01,
    b2 0.9, start 0.6, max 12), computed by hand:

    step  drafted/accepted  AR~                        gamma~            gamma
    1     4/4               0.5 (< 0.9)                0.6 + 0.01        0.9*0.6 + 0.1*0.61 = 0.601
    2     12/12             0.75                       0.611             0.602
    3     5/5               0.875                      0.612             0.603
    4     6/6               0.9375 (>= 0.9, not max)   0.603 - 0.01      0.602
    5     12/12             0.96875 (hit the max)      0.602 (kept)      0.602
    6     4/0               0.484375                   0.612             0.603
    """
    stop = parse_draft_stop("dv")
    assert isinstance(stop, DraftVerifyStop) and stop.threshold == 0.6
    expected = [(0.5, 0.601), (0.75, 0.602), (0.875, 0.603), (0.9375, 0.602), (0.96875, 0.602), (0.484375, 0.603)]
    for (drafted, accepted), (ar, gamma) in zip([(4, 4), (12, 12), (5, 5), (6, 6), (12, 12), (4, 0)], expected):
        assert stop.max_depth(16) == 12  # the paper's max, under the engine's k
        stop.observe(drafted, accepted)
        assert stop.acceptance == pytest.approx(ar)
        assert stop.threshold == pytest.approx(gamma)
    assert stop.keep_going(1, top1(0.6031)) and not stop.keep_going(1, top1(0.6029))
    assert stop.max_depth(3) == 3  # never past the engine's k (token budget, verify width)


def test_heuristic_schedule_is_plus_two_minus_one_within_k():
    stop = HeuristicStop()
    seen = []
    for drafted_accepted in [None, (8, 8), (8, 3), (7, 7), (8, 0), (7, 0), (6, 6)]:
        if drafted_accepted:
            stop.observe(*drafted_accepted)
        seen.append(stop.max_depth(8))
    assert seen == [8, 8, 7, 8, 7, 6, 8]
    for _ in range(20):
        stop.observe(stop.max_depth(8), 0)
    assert stop.max_depth(8) == 1


def test_confidence_stops_below_the_threshold():
    stop = ConfidenceStop(0.7)
    assert stop.keep_going(1, top1(0.71)) and not stop.keep_going(1, top1(0.69))
    assert stop.max_depth(5) == 5


def test_cost_policy_drafts_while_one_more_token_raises_the_rate():
    # t_ar 1, one draft step 0.1, a verify pass of n tokens 1 + 0.2 (n - 1).
    costs = StepCosts(t_ar=1.0, t_draft=0.1, verify={n: 1 + 0.2 * (n - 1) for n in range(1, 14)})
    stop = CostStop(costs)
    assert stop.max_depth(16) == 12
    # depth 1 at confidence 0.9: E = 1.9 in T = 0.1 + 1.2 = 1.3 s; one more adds 0.81 tokens
    # for 0.3 s: 2.7 tokens/s > 1.46 -> keep going.
    assert stop.keep_going(1, top1(0.9))
    # depth 2 at 0.3: P = 0.27, E = 2.17, T = 1.6; one more adds 0.081 for 0.3 s -> stop.
    assert not stop.keep_going(2, top1(0.3))
    stop.max_depth(16)  # a new chain starts from scratch
    assert not stop.keep_going(1, top1(0.3))  # 0.09 / 0.3 = 0.3 < 1.3 / 1.3
    # When verifying more tokens is nearly free, only the draft step costs: keep going.
    flat = CostStop(StepCosts(t_ar=1.0, t_draft=0.1, verify={n: 1.0 for n in range(1, 14)}))
    flat.max_depth(16)
    assert flat.keep_going(1, top1(0.6))  # 0.36 / 0.1 = 3.6 > 1.6 / 1.1
    stop.max_depth(16)
    assert not stop.keep_going(1, top1(0.6))  # 0.36 / 0.3 = 1.2 < 1.6 / 1.3


def test_the_cost_policy_takes_costs_as_data():
    """Any object with t_drafting, t_verify and overhead will do: drafters do not depend on
    the policy layer's StepCosts."""

    class Table:
        overhead = 0.0

        def t_drafting(self, k):
            return 0.1 * k

        def t_verify(self, n):
            return 1 + 0.2 * (n - 1)

    stop = CostStop(Table())
    stop.max_depth(16)
    assert stop.keep_going(1, top1(0.9)) and not stop.keep_going(2, top1(0.3))  # as with StepCosts above


def test_drafters_import_nothing_from_the_policy_layer():
    import ast
    from pathlib import Path

    import quickdraft.drafters as drafters

    for path in Path(drafters.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = ("." * node.level) + (node.module or "")
                assert not module.startswith(("..policy", "quickdraft.policy")), (path.name, module)
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("quickdraft.policy") for a in node.names), path.name


@pytest.mark.parametrize("spec,message", [
    ("sometimes", "is not a policy"),
    ("confidence", "threshold in (0, 1)"),
    ("confidence:1.5", "threshold in (0, 1)"),
    ("dv:speed=3", "dv settings"),
    ("dv:max=0", "dv settings"),
])
def test_bad_specs_are_one_line_errors(spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        parse_draft_stop(spec)
    assert "\n" not in str(info.value)


def run(target, ids, n, drafter=None, k=4, stats=None):
    steps = decode(target, ids, StopConditions(n, ()), drafter=drafter, num_speculative_tokens=k, stats=stats)
    return [t for s in steps for t in s.tokens]


def bound(spec: str, target):
    stop = parse_draft_stop(spec)
    if isinstance(stop, CostStop):  # measured costs in real use; a plausible CPU shape here
        stop.costs = StepCosts(t_ar=1.0, t_draft=0.15, verify={n: 1 + 0.15 * (n - 1) for n in range(1, 14)})
    return stop


@pytest.mark.parametrize("spec", POLICIES)
def test_every_policy_keeps_greedy_output_equal_to_plain(models, spec):
    tok, target, drafts = models
    for prompt in PROMPTS:
        ids = torch.tensor(tok(prompt)["input_ids"])
        reference = run(target, ids, 30)
        for draft_name, k in (("perturbed", 6), ("copy", 12)):
            drafter = DraftModelDrafter(drafts[draft_name], target.vocab_size, stop=bound(spec, target))
            assert run(target, ids, 30, drafter, k) == reference, (prompt, draft_name, k)


def test_policies_change_how_much_is_drafted(models):
    """Not a no-op: a strict threshold drafts less per step than fixed k; dv learns from
    each verification (its threshold moves); the heuristic shrinks on a poor draft."""
    tok, target, drafts = models
    ids = torch.tensor(tok(PROMPTS[0])["input_ids"])
    drafted = {}
    for spec in ("fixed", "confidence:0.99"):
        stats = GenerationStats()
        run(target, ids, 40, DraftModelDrafter(drafts["unrelated"], target.vocab_size, stop=bound(spec, target)),
            6, stats)
        drafted[spec] = stats.drafted_tokens / stats.target_forward_passes
    assert drafted["fixed"] > 5 and drafted["confidence:0.99"] < 3
    dv = parse_draft_stop("dv")
    run(target, ids, 40, DraftModelDrafter(drafts["unrelated"], target.vocab_size, stop=dv), 12)
    assert dv.threshold > 0.6  # the unrelated draft is mostly rejected: stop sooner
    heuristic = HeuristicStop()
    run(target, ids, 40, DraftModelDrafter(drafts["unrelated"], target.vocab_size, stop=heuristic), 8)
    assert heuristic.current < 8


@pytest.mark.parametrize("spec", ["confidence:0.5", "confidence:0.95", "dv", "dv:start=0.2,max=5"])
def test_a_confidence_floor_ends_the_c_chain_where_the_python_loop_ends(models, spec, monkeypatch):
    """confidence and dv stop on the draft's top-1 probability alone (``min_confidence``),
    so the draft model's greedy chain applies it inside its one C call: the same chains,
    token for token and length for length, as the Python loop that asks ``keep_going``
    after each token, and greedy output stays plain decoding's."""
    from quickdraft.models import cpu_kernels
    from quickdraft.models.lm import NativeLM

    if cpu_kernels.library() is None:
        pytest.skip("needs the compiled CPU kernels")
    tok, target, drafts = models
    chained = NativeLM.greedy_chain
    runs, ended_early = [], []
    for in_c in (True, False):
        calls = []

        def chain(self, first, n, *args, in_c=in_c, calls=calls, **kwargs):
            tokens = chained(self, first, n, *args, **kwargs) if in_c else None
            calls.append(tokens is not None)
            ended_early.append(tokens is not None and len(tokens) < n + 1)
            return tokens

        monkeypatch.setattr(NativeLM, "greedy_chain", chain)
        out = []
        for prompt in PROMPTS:
            ids = torch.tensor(tok(prompt)["input_ids"])
            stats = GenerationStats()
            drafter = DraftModelDrafter(drafts["perturbed"], target.vocab_size, stop=bound(spec, target))
            tokens = run(target, ids, 30, drafter, 8, stats)
            assert tokens == run(target, ids, 30)
            out.append((tokens, stats.drafted_per_position, stats.accepted_per_position))
        assert calls and all(calls) == in_c
        runs.append(out)
    assert runs[0] == runs[1]
    assert any(ended_early)  # the floor ended some chains inside the call
