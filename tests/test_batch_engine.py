"""Batched speculative decoding: lossless per row, batch invariant, continuous batching."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from quickdraft.batch_generate import make_batch_engine
from quickdraft.decoding.batch_engine import BatchFullError
from quickdraft.decoding.engine import decode
from quickdraft.decoding.sampling import SamplingParams
from quickdraft.decoding.stats import GenerationStats
from quickdraft.decoding.step import ContextOverflowError
from quickdraft.decoding.stopping import StopConditions
from quickdraft.drafters import DraftModelDrafter, NoDrafter
from quickdraft.drafters.batched import make_batch_drafter
from quickdraft.drafters.shapes import StaticTree
from quickdraft.models.decode_linear import canonical_rows
from quickdraft.models.ragged import Feed, ragged_forward

MAX_NEW = 24


@pytest.fixture(scope="module")
def prompts(models):
    tok = models[0]
    texts = ["def add(a, b):\n", "for i in range(10):\n    print(i, i * i)\n" * 4, "x", "class Point:\n"]
    ids = [torch.tensor(tok(t)["input_ids"]) for t in texts]
    assert ids[2].numel() == 1 and ids[1].numel() > 10 * ids[0].numel() // 2  # very different lengths
    return ids


def plain(target, ids, stop):
    return [t for s in decode(target, ids, stop, drafter=NoDrafter()) for t in s.tokens]


def run(engine, jobs, join_at=None, cancel=None):
    """Run ``jobs`` (prompt, params, stop) through ``engine``; ``join_at`` {step: job index}
    adds a job mid-way, ``cancel`` (step, job index) cancels one. Returns tokens and finish per job."""
    join_at = join_at or {}
    rows, out, finish = {}, {}, {}
    for i, (ids, params, stop) in enumerate(jobs):
        if i not in join_at.values():
            rows[engine.add(ids, params, stop)] = i
    step = 0
    while engine.active or any(i not in rows.values() for i in join_at.values()):
        for i in [j for s, j in join_at.items() if s == step]:
            ids, params, stop = jobs[i]
            rows[engine.add(ids, params, stop)] = i
        if cancel and cancel[0] == step:
            row = next(r for r, j in rows.items() if j == cancel[1])
            before = engine.free_slots
            engine.cancel(row)
            assert engine.free_slots == before + 1
            finish[cancel[1]] = "cancelled"
        for row, update in engine.step().items():
            out.setdefault(rows[row], []).extend(update.tokens)
            assert update.drafted <= len(update.tokens)
            if update.finish:
                finish[rows[row]] = update.finish
        step += 1
    return out, finish


def test_canonical_row_counts_round_every_row_alike():
    """The fallback without oneDNN: plain products (MKL) at canonical row counts."""
    torch.manual_seed(0)
    w = torch.randn(64, 200)
    x = torch.randn(80, 64)
    reference = x @ w
    for rows in sorted({canonical_rows(n) for n in range(1, 81)}):
        assert torch.equal(x[:rows] @ w, reference[:rows]), rows


def test_ragged_forward_logits_do_not_depend_on_the_batch(models, prompts):
    """Bit for bit: a row's logits alone equal its logits next to any other rows (packed
    after or before rows of other lengths)."""
    target = models[1]
    model = target.model
    rows = [*prompts, prompts[1][:7], prompts[0]]  # six cache rows
    cache = model.new_cache(len(rows), 160)
    for slot, ids in enumerate(rows):
        ragged_forward(model, cache, [Feed(slot, 0, ids, 0)])
    widths = [1, 5, 3, 2, 4, 1]

    def feed(slot):
        return Feed(slot, rows[slot].numel(), torch.arange(3, 3 + widths[slot]), widths[slot])

    alone = {s: ragged_forward(model, cache, [feed(s)])[0] for s in range(len(rows))}
    for group in ([0, 1], [1, 2, 3], [3, 0, 2, 1], [2, 0], [5, 3, 0, 4, 2, 1]):
        together = ragged_forward(model, cache, [feed(s) for s in group])
        for s, logits in zip(group, together):
            assert torch.equal(logits, alone[s]), (group, s)


class BooleanSelections(TorchDispatchMode):
    """Records the ops that would read a device tensor's values back to the host on a GPU:
    selection by a boolean mask (``aten.index`` / ``index_put_`` with a bool index) and
    ``nonzero``."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        indices = args[1] if name.startswith(("aten.index.", "aten.index_put")) and len(args) > 1 else ()
        if "nonzero" in name or any(i is not None and i.dtype == torch.bool for i in indices):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def test_padded_ragged_passes_match_the_row_loop_and_select_by_index_lists(models, prompts, monkeypatch):
    """The GPU's layout of a ragged pass (one padded attention call, ``PaddedRows``), run on
    the CPU: each row's logits as the row loop gives them, up to rounding, and inside the
    layers no selection by a boolean mask (on a GPU each is a host sync: four a layer made
    `train data --device cuda` as slow as the CPU, session 49)."""
    from quickdraft.models import transformer

    model = models[1].model
    rows = [*prompts, prompts[1][:7]]
    widths = [1, 5, 3, 2, 4]
    selections = BooleanSelections()  # in the layers (the layout is made on the host)
    forward = transformer.Attention.forward

    def watched(self, *args, **kwargs):
        with selections:
            return forward(self, *args, **kwargs)

    monkeypatch.setattr(transformer.Attention, "forward", watched)
    results = []
    for devices in (("cpu",), ()):
        monkeypatch.setattr(transformer, "PADDED_RAGGED_DEVICES", devices)
        cache = model.new_cache(len(rows), 160)
        first = ragged_forward(model, cache, [Feed(s, 0, ids, 0) for s, ids in enumerate(rows)])
        feeds = [Feed(s, rows[s].numel(), torch.arange(3, 3 + w), w) for s, w in enumerate(widths)]
        layout = model.ragged_inputs(torch.zeros(1, dtype=torch.long), cache,
                                     [transformer.RaggedRow(f.cache_row, f.start, f.tokens.numel()) for f in feeds])[1]
        assert isinstance(layout, transformer.PaddedRows) == bool(devices)
        selections.seen.clear()
        step = ragged_forward(model, cache, feeds)
        if devices:
            assert selections.seen == []
        results.append([*first, *step])
    for padded, loop in zip(*results):
        torch.testing.assert_close(padded, loop, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["draft", "ngram", "hybrid"])
def test_greedy_rows_equal_plain_decoding_and_their_solo_runs(models, prompts, method):
    tok, target, drafts = models
    eos = [tok.eos_token_id]
    budgets = [MAX_NEW, 9, MAX_NEW, 15]  # rows finish at different steps
    jobs = [(ids, SamplingParams(), StopConditions(n, eos)) for ids, n in zip(prompts, budgets)]
    expected = [plain(target, ids, StopConditions(n, eos)) for ids, n in zip(prompts, budgets)]

    def engine(size):
        return make_batch_engine(target, method=method, draft=drafts["perturbed"], max_batch_size=size,
                           max_len=200, num_speculative_tokens=4)

    # Three rows at once; the fourth joins mid-way; a fifth copy of row 0 is cancelled.
    jobs_plus = jobs + [(prompts[0], SamplingParams(), StopConditions(MAX_NEW, eos))]
    out, finish = run(engine(4), jobs_plus, join_at={3: 3, 1: 4}, cancel=(2, 4))
    for i in range(4):
        assert out[i] == expected[i], i
        solo, _ = run(engine(1), [(prompts[i], SamplingParams(), StopConditions(budgets[i], eos))])
        assert solo[0] == expected[i]
    assert finish[1] == "length" and finish[4] == "cancelled"


def test_seeded_sampled_rows_reproduce_their_solo_output(models, prompts):
    tok, target, drafts = models
    eos = [tok.eos_token_id]
    params = [SamplingParams(0.8, seed=1), SamplingParams(1.0, top_p=0.9, seed=2), SamplingParams(),
              SamplingParams(0.6, top_k=20, seed=3)]
    jobs = [(ids, p, StopConditions(MAX_NEW, eos)) for ids, p in zip(prompts, params)]

    def engine(size):
        return make_batch_engine(target, method="draft", draft=drafts["perturbed"], max_batch_size=size,
                           max_len=200, num_speculative_tokens=3)

    together, _ = run(engine(4), jobs, join_at={2: 1})
    for i, (ids, p, _) in enumerate(jobs):
        solo, _ = run(engine(1), [(ids, p, StopConditions(MAX_NEW, eos))])
        assert together[i] == solo[0], i
        # The single-sequence engine, same seed and k, draws the same random numbers.
        single = decode(target, ids, StopConditions(MAX_NEW, eos),
                        drafter=DraftModelDrafter(drafts["perturbed"], target.vocab_size),
                        params=p, num_speculative_tokens=3)
        assert together[i] == [t for s in single for t in s.tokens], i


def test_per_row_stop_strings_eos_and_budgets(models, prompts):
    tok, target, drafts = models
    eos = [tok.eos_token_id]
    first = plain(target, prompts[1], StopConditions(MAX_NEW, eos))
    text = tok.decode(first)
    stop_at = text[len(text) // 3 : len(text) // 3 + 2]
    eos_row = [first[4]]  # pretend a generated token is EOS: the row stops before it
    stops = [StopConditions(MAX_NEW, eos, [stop_at], tok), StopConditions(MAX_NEW, eos_row),
             StopConditions(3, eos), StopConditions(1, eos)]
    rows = [prompts[1], prompts[1], prompts[0], prompts[3]]
    expected, reasons = [], []
    for ids, stop in zip(rows, [StopConditions(MAX_NEW, eos, [stop_at], tok), StopConditions(MAX_NEW, eos_row),
                                StopConditions(3, eos), StopConditions(1, eos)]):
        stats_steps = list(decode(target, ids, stop, drafter=NoDrafter()))
        expected.append([t for s in stats_steps for t in s.tokens])
    engine = make_batch_engine(target, method="draft", draft=drafts["copy"], max_batch_size=4, max_len=200,
                         num_speculative_tokens=5)
    out, finish = run(engine, [(ids, SamplingParams(), stop) for ids, stop in zip(rows, stops)])
    assert [out.get(i, []) for i in range(4)] == expected
    reasons = [finish[i] for i in range(4)]
    assert reasons == ["stop", "stop", "length", "length"]
    assert stop_at in tok.decode(out[0]) and len(out[1]) == first.index(first[4])


def test_slots_overflow_and_cancel(models, prompts):
    tok, target, drafts = models
    engine = make_batch_engine(target, method="ngram", max_batch_size=2, max_len=64, num_speculative_tokens=2)
    a = engine.add(prompts[0], SamplingParams(), StopConditions(4, [tok.eos_token_id]))
    engine.add(prompts[2], SamplingParams(), StopConditions(4, [tok.eos_token_id]))
    assert engine.free_slots == 0 and engine.active == 2
    with pytest.raises(BatchFullError):
        engine.add(prompts[3], SamplingParams(), StopConditions(4, [tok.eos_token_id]))
    engine.cancel(a)
    assert engine.free_slots == 1 and engine.active == 1
    with pytest.raises(ContextOverflowError):
        engine.add(torch.zeros(64, dtype=torch.long), SamplingParams(), StopConditions(4, []))
    engine.add(prompts[3], SamplingParams(), StopConditions(4, [tok.eos_token_id]))
    assert engine.active == 2
    while engine.active:
        engine.step()
    assert engine.free_slots == 2
    with pytest.raises(ValueError, match="does not batch"):
        make_batch_engine(target, method="tree", max_batch_size=2)


def test_one_drafter_interface_serves_both_loops(models, prompts):
    """Batch 1 is a batch of one: a batched drafter drafts for ``decode`` (slot 0); a
    one-sequence drafter drafts for the batched engine's first row but refuses a second
    slot, which stays free; the batched engine refuses a token tree."""
    tok, target, drafts = models
    eos = [tok.eos_token_id]
    expected = plain(target, prompts[0], StopConditions(MAX_NEW, eos))
    batched = make_batch_drafter("draft", drafts["perturbed"], target, 2, 200)
    stats = GenerationStats()
    steps = decode(target, prompts[0], StopConditions(MAX_NEW, eos), drafter=batched, num_speculative_tokens=4,
                   stats=stats)
    assert [t for s in steps for t in s.tokens] == expected and stats.accepted_tokens > 0
    with pytest.raises(ValueError, match="keeps 200 tokens per row"):
        batched.join(0, prompts[0], SamplingParams(), torch.Generator(), 201)
    with pytest.raises(ValueError, match="has 2 slots, not slot 2"):
        batched.join(2, prompts[0], SamplingParams(), torch.Generator(), 100)

    single = DraftModelDrafter(drafts["perturbed"], target.vocab_size)
    engine = make_batch_engine(target, drafter=single, max_batch_size=2, max_len=200, num_speculative_tokens=4)
    engine.add(prompts[0], SamplingParams(), StopConditions(MAX_NEW, eos))
    with pytest.raises(ValueError, match="one sequence at a time"):
        engine.add(prompts[3], SamplingParams(), StopConditions(MAX_NEW, eos))
    assert engine.free_slots == 1 and engine.active == 1
    out = []
    while engine.active:
        out += [t for update in engine.step().values() for t in update.tokens]
    assert out == expected

    tree = DraftModelDrafter(drafts["perturbed"], target.vocab_size, StaticTree((2, 1)))
    engine = make_batch_engine(target, drafter=tree, max_batch_size=1, max_len=200, num_speculative_tokens=2)
    engine.add(prompts[0], SamplingParams(), StopConditions(MAX_NEW, eos))
    with pytest.raises(ValueError, match="token tree"):
        engine.step()


def test_policy_turns_speculation_off_when_verification_is_compute_bound():
    from quickdraft.policy.batch_policy import BatchPolicy

    # Batch 1: a 9-token pass costs 1.2 plain steps (memory-bound); batch 8: 9x (compute-bound).
    table = {"verify": {"1": {str(w): 1.0 + 0.025 * (w - 1) for w in range(1, 10)},
                        "8": {str(w): 2.0 * w for w in range(1, 10)}},
             "draft": {"1": 0.1, "8": 0.15}}
    policy = BatchPolicy(table)
    assert policy.k(1) >= 3
    assert policy.k(8) == 0
    assert 0 <= policy.k(4) <= policy.k(1)


def test_a_lone_row_speculates_whenever_generate_would():
    """Predicted 1.05x faster: ``generate`` drafts (it needs > 1.0x), and so does a lone row
    of the batched engine, which uses generate's kernels; several rows keep the margin."""
    from quickdraft.policy import cost_model
    from quickdraft.policy.batch_policy import MIN_GAIN, BatchPolicy

    # Verification of width 2 costs 1.5 plain steps, a draft step 0.1: the first draft token
    # accepted at 0.68 and no later one, k=1 gives (1 + 0.68) / 1.6 = 1.05x.
    verify = {str(w): 1.0 + 0.5 * (w - 1) for w in range(1, 10)}
    table = {"verify": {"1": verify, "2": verify}, "draft": {"1": 0.1, "2": 0.1}}
    acceptance = [0.68] + [0.0] * 7
    policy = BatchPolicy(table, prior=acceptance)
    costs = policy.costs(1)
    k = cost_model.best_k(costs, per_position=acceptance, max_k=policy.max_k)
    assert 1.0 < cost_model.predicted_speedup(k, costs, per_position=acceptance) < MIN_GAIN
    assert policy.k(1) == k > 0
    assert policy.k(2) == 0


def test_policy_interpolates_costs_on_the_rows_length():
    """Calibrated at two contexts: at long rows a wide verify pass costs much more than at
    short ones (attention), so the same acceptance buys a smaller k."""
    from quickdraft.decoding.stats import RecentAcceptance
    from quickdraft.policy.batch_policy import BatchPolicy

    short = {"context": 256, "verify": {"4": {str(w): 1.0 + 0.1 * (w - 1) for w in range(1, 10)}},
             "draft": {"4": 0.05}}
    long = {"context": 1024, "verify": {"4": {str(w): 1.5 + 0.5 * (w - 1) for w in range(1, 10)}},
            "draft": {"4": 0.06}}
    policy = BatchPolicy({"calibrations": [long, short]})
    assert policy.costs(4, 100).verify[5] == policy.costs(4).verify[5] == pytest.approx(1.4)
    assert policy.costs(4, 640).verify[5] == pytest.approx(0.5 * (1.4 + 3.5))
    assert policy.costs(4, 1792).verify[5] == pytest.approx(3.5 + (3.5 - 1.4))  # linear past 1024
    recent = RecentAcceptance()
    for i in range(90):  # accepted 0..8 equally often
        recent.record_step(8, i % 9)
    assert policy.k(4, recent, context=200) > policy.k(4, recent, context=1500) > 0


def test_engine_with_the_measured_policy_stays_lossless(models, prompts, private_cache_dir):
    tok, target, drafts = models
    eos = [tok.eos_token_id]
    engine = make_batch_engine(target, method="draft", draft=drafts["copy"], max_batch_size=2, max_len=120)
    assert engine.policy is not None and 0 <= engine.k_for(2) <= 8
    assert list(private_cache_dir.glob("quickdraft/autok/batch-*.json"))  # measured once, cached
    jobs = [(ids, SamplingParams(), StopConditions(12, eos)) for ids in prompts[:2]]
    out, _ = run(engine, jobs)
    assert [out[0], out[1]] == [plain(target, ids, StopConditions(12, eos)) for ids in prompts[:2]]


def test_policy_acceptance_follows_recent_proposals():
    """The batch policy sees the acceptance of recent proposals, not of every prompt since
    the engine started: after a run of poor acceptance, the earlier good run is forgotten."""
    from quickdraft.decoding.stats import RecentAcceptance

    recent = RecentAcceptance(window=8)
    for _ in range(8):
        recent.record_step(4, 4)
    assert recent.per_position_acceptance == [1.0] * 4
    for _ in range(8):
        recent.record_step(4, 0)
    assert recent.per_position_acceptance == [0.0] * 4 and recent.drafted_tokens == 32
    recent.record_step(0, 0)  # a plain step proposes nothing and says nothing about acceptance
    assert len(recent.steps) == 8


def test_policy_answer_is_kept_until_acceptance_changes():
    from quickdraft.decoding.stats import RecentAcceptance
    from quickdraft.policy.batch_policy import BatchPolicy

    table = {"verify": {"1": {str(w): 1.0 + 0.025 * (w - 1) for w in range(1, 10)}}, "draft": {"1": 0.1}}
    policy = BatchPolicy(table)
    recent = RecentAcceptance()
    for _ in range(40):
        recent.record_step(4, 4)
    k = policy.k(1, recent)
    assert k >= 3 and policy.k(1, recent) == k == policy._choose(1, recent)
    for _ in range(300):  # acceptance collapses: a new version, a new answer
        recent.record_step(4, 0)
    assert policy.k(1, recent) == policy._choose(1, recent) == 0
    recent.record_step(0, 0)  # a plain step: nothing new, the kept answer stands
    assert policy.k(1, recent) == 0


def test_policy_drafts_again_after_a_stretch_of_plain_steps():
    """Poor acceptance turns speculation off; plain steps record no acceptance, so after
    FORGET_AFTER of them the policy forgets and drafts under its prior again (measuring
    afresh) instead of staying off for the engine's lifetime."""
    from quickdraft.decoding.stats import FORGET_AFTER, RecentAcceptance
    from quickdraft.policy.batch_policy import BatchPolicy

    table = {"verify": {"4": {str(w): 1.0 + 0.2 * (w - 1) for w in range(1, 10)}}, "draft": {"4": 0.05}}
    policy = BatchPolicy(table)
    recent = RecentAcceptance()
    for _ in range(40):
        recent.record_step(4, 0)
    assert policy.k(4, recent) == 0
    for _ in range(FORGET_AFTER - 1):
        recent.record_plain_step()
    assert policy.k(4, recent) == 0 and recent.drafted_tokens == 160
    recent.record_plain_step()
    assert recent.drafted_tokens == 0 and policy.k(4, recent) > 0  # the prior: drafting again
    recent.record_step(4, 1)
    for _ in range(FORGET_AFTER - 1):
        recent.record_plain_step()
    assert recent.drafted_tokens == 4  # a proposal restarts the count


def test_policy_caps_a_disturbed_timing_by_the_larger_passes():
    """A pass over fewer tokens or rows never costs more than one over more: a calibration
    value above a larger width's (or batch's) is noise and is capped by it."""
    from quickdraft.policy.batch_policy import BatchPolicy

    table = {"verify": {"1": {"1": 4.6, "5": 5.5, "7": 11.2, "9": 6.1}, "2": {"1": 5.0, "5": 5.2, "7": 7.0, "9": 8.0}},
             "draft": {"1": 0.9, "2": 0.5}}
    cal = BatchPolicy(table).calibrations[0]
    assert cal.verify[1] == {1: 4.6, 5: 5.2, 7: 6.1, 9: 6.1}  # capped by width 9, and by batch 2
    assert cal.verify[2] == {1: 5.0, 5: 5.2, 7: 7.0, 9: 8.0}
    assert cal.draft == {1: 0.5, 2: 0.5}


def test_engine_drafts_again_after_the_policy_turned_speculation_off(models, prompts):
    """In the engine: acceptance that turned speculation off is forgotten after
    FORGET_AFTER plain steps, and a draft that is right (a copy of the target) takes over."""
    from quickdraft.decoding.stats import FORGET_AFTER
    from quickdraft.policy.batch_policy import BatchPolicy

    tok, target, drafts = models
    table = {"verify": {"1": {str(w): 1.0 + 0.05 * (w - 1) for w in range(1, 10)}}, "draft": {"1": 0.05}}
    engine = make_batch_engine(target, method="draft", draft=drafts["copy"], max_batch_size=1, max_len=120,
                         policy=BatchPolicy(table))
    for _ in range(40):  # a poor stretch before this row
        engine.pooled.record_step(4, 0)
    assert engine.k_for(1) == 0
    row = engine.add(prompts[0], SamplingParams(), StopConditions(FORGET_AFTER + 20))
    drafted = []
    while engine.active:
        drafted.append(engine.step()[row].drafted)
    assert sum(drafted[:FORGET_AFTER]) == 0 and sum(drafted[FORGET_AFTER:]) > 0


def test_row_stats_count_only_the_accepted_drafts_eos_leaves(models, prompts):
    """As engine.decode does: a chunk cut at EOS counts only the accepted drafts before the cut
    (0 new tokens never come with accepted drafts), and stopped_by says EOS ended the row."""
    tok, target, drafts = models
    first = plain(target, prompts[1], StopConditions(MAX_NEW, [tok.eos_token_id]))
    for position in (0, 2):
        cut = first.index(first[position])  # the copy draft's first chain (k=5) is first[:5], all accepted
        engine = make_batch_engine(target, method="draft", draft=drafts["copy"], max_batch_size=1, max_len=200,
                                   num_speculative_tokens=5)
        row = engine.add(prompts[1], SamplingParams(), StopConditions(MAX_NEW, [first[position]]))
        update = engine.step()[row]
        stats = update.stats
        assert update.finish == "stop" and len(update.tokens) == stats.new_tokens == cut
        assert stats.drafted_tokens == 5 and stats.accepted_tokens == cut, stats
        assert stats.prefill_tokens == cut and stats.stopped_by == "eos"


def test_a_lone_row_drafts_with_the_lone_sequence_kernels(models, prompts, monkeypatch):
    """A draft pass over one row's one token takes the kernels `quickdraft generate`'s
    drafter takes for a lone sequence (``row_dependent_rounding``); a pass over several
    rows the batch-invariant ones. (Before: every batched draft step took the invariant
    kernels, ~1.7x a lone step on the embedded draft, so one stream through the server
    decoded ~25% slower than `generate` and the batch policy priced 1-row speculation by
    that.) Greedy output is the target's either way."""
    from quickdraft.drafters import batched
    from quickdraft.models import decode_linear

    tok, target, drafts = models
    eos = [tok.eos_token_id]
    seen: list[tuple[int, bool]] = []
    real = batched.ragged_forward

    def spy(model, cache, feeds, *args, **kwargs):
        if all(f.tokens.numel() == 1 for f in feeds):
            seen.append((len(feeds), getattr(decode_linear._rounding, "free", False)))
        return real(model, cache, feeds, *args, **kwargs)

    monkeypatch.setattr(batched, "ragged_forward", spy)
    engine = make_batch_engine(target, method="draft", draft=drafts["copy"], max_batch_size=2, max_len=120,
                               num_speculative_tokens=3)
    first = engine.add(prompts[0], SamplingParams(), StopConditions(12, eos))
    for _ in range(2):
        engine.step()
    assert seen and all(free for rows, free in seen if rows == 1), seen
    seen.clear()
    engine.add(prompts[3], SamplingParams(), StopConditions(12, eos))
    tokens = {first: []}
    while engine.active:
        for row, update in engine.step().items():
            tokens.setdefault(row, []).extend(update.tokens)
    assert any(rows == 2 for rows, _ in seen) and not any(free for rows, free in seen if rows == 2), seen
    assert tokens[1] == plain(target, prompts[3], StopConditions(12, eos))


@pytest.fixture
def padded_rows_on_cpu(monkeypatch):
    """Ragged passes attend in one padded call here too (as they do on CUDA)."""
    from quickdraft.models import transformer

    monkeypatch.setattr(transformer, "PADDED_RAGGED_DEVICES", ("cuda", "cpu"))


def test_padded_attention_matches_the_row_loop(models, prompts, monkeypatch):
    """The one-call layout of a ragged pass (GPUs) gives each row its row-by-row logits and
    cache (up to rounding: the padding changes the sums' lengths)."""
    from quickdraft.models import transformer

    model = models[1].model
    rows = [*prompts, prompts[1][:7]]
    widths = [1, 5, 3, 2, 4]
    results = []
    for devices in (("cuda",), ("cuda", "cpu")):
        monkeypatch.setattr(transformer, "PADDED_RAGGED_DEVICES", devices)
        cache = model.new_cache(len(rows), 160)
        prefill = ragged_forward(model, cache, [Feed(s, 0, ids, 1) for s, ids in enumerate(rows)])
        step = ragged_forward(model, cache, [Feed(s, rows[s].numel(), torch.arange(3, 3 + widths[s]), widths[s])
                                             for s in (3, 0, 4, 2, 1)])
        results.append((prefill, step, cache.k.clone(), cache.v.clone()))
    (prefill, step, k, v), (prefill_p, step_p, k_p, v_p) = results
    for a, b in zip([*prefill, *step], [*prefill_p, *step_p]):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(k_p, k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(v_p, v, rtol=1e-4, atol=1e-4)
    assert k.abs().sum() > 0  # the caches were written


@pytest.mark.parametrize("method", ["ar", "draft"])
def test_padded_attention_rows_equal_plain_decoding(models, prompts, method, padded_rows_on_cpu):
    tok, target, drafts = models
    eos = [tok.eos_token_id]
    budgets = [MAX_NEW, 9, MAX_NEW, 15]
    jobs = [(ids, SamplingParams(), StopConditions(n, eos)) for ids, n in zip(prompts, budgets)]
    engine = make_batch_engine(target, method=method, draft=drafts["perturbed"], max_batch_size=4, max_len=200,
                               num_speculative_tokens=None if method == "ar" else 4)
    out, _ = run(engine, jobs, join_at={3: 3})
    for i, (ids, n) in enumerate(zip(prompts, budgets)):
        assert out[i] == plain(target, ids, StopConditions(n, eos)), i


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_chunked_prefill_changes_no_row_and_lets_the_others_decode(models, prompts, method):
    """``prefill_chunk``: a long prompt joining mid-way is prefilled 5 tokens a step (all
    joining rows together); every row's output, greedy or seeded sampling, is the same as
    with whole prompts, and the row already decoding gets tokens at every step meanwhile."""
    tok, target, drafts = models
    params = [SamplingParams(), SamplingParams(0.8, seed=1), SamplingParams(1.0, seed=2)]
    jobs = [(prompts[0], params[0], 150), (prompts[1], params[1], MAX_NEW), (prompts[3], params[2], MAX_NEW)]

    def decode_all(chunk):
        engine = make_batch_engine(target, method=method, draft=drafts["perturbed"], max_batch_size=3,
                                   max_len=200, num_speculative_tokens=3, prefill_chunk=chunk)
        first = engine.add(jobs[0][0], jobs[0][1], StopConditions(jobs[0][2], []))
        out, steps = {first: []}, []
        while len(out[first]) < 4:  # its own prompt in two chunks, then decoding
            update = engine.step().get(first)
            out[first] += update.tokens if update else []
        for ids, p, n in jobs[1:]:  # two rows join at once: the longer prompt's chunks first
            out[engine.add(ids, p, StopConditions(n, [tok.eos_token_id]))] = []
        while engine.active:
            updates = engine.step()
            steps.append(updates)
            for row, update in updates.items():
                out[row] += update.tokens
        return list(out.values()), steps

    whole, _ = decode_all(None)
    chunked, steps = decode_all(5)
    assert chunked == whole
    waited = next(i for i, updates in enumerate(steps) if 1 in updates)  # steps before the long row's first token
    assert waited >= prompts[1].numel() // 5 - 1
    assert all(updates[0].tokens for updates in steps[:waited])  # the first row went on meanwhile


def test_prefill_chunk_is_left_to_drafters_that_read_the_target_prefill(models):
    """Early exit takes the target's prefill into its own cache whole: no chunks for it."""
    from quickdraft.drafters.factory import DraftOptions

    _, target, _ = models
    engine = make_batch_engine(target, method="early-exit", max_batch_size=2, max_len=60, num_speculative_tokens=2,
                               options=DraftOptions(exit_head="shared", exit_layer=1), prefill_chunk=5)
    assert engine.prefill_chunk is None
    with pytest.raises(ValueError, match="prefill_chunk must be >= 1"):
        make_batch_engine(target, method="ar", max_batch_size=2, max_len=60, prefill_chunk=0)
