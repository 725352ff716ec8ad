"""Early exit in the batched engine: lossless per row, batch invariant (its drafts too),
freed slots reused, and wired into make_batch_drafter, generate --prompts-file and serve."""

from __future__ import annotations

import json

import pytest
import torch
from test_early_exit import native_lm, random_head

from quickdraft.batch_generate import batch_method, make_batch_engine
from quickdraft.cli import main
from quickdraft.decoding.batch_engine import BatchEngine
from quickdraft.decoding.engine import decode
from quickdraft.decoding.sampling import SamplingParams
from quickdraft.decoding.stopping import StopConditions
from quickdraft.drafters import DraftOptions, NoDrafter
from quickdraft.drafters.batched import BatchedEarlyExit, make_batch_drafter
from quickdraft.drafters.early_exit import EarlyExitDrafter
from quickdraft.models.lm import NativeLM
from quickdraft.models.ragged import Feed

EXIT = 2
# Very different lengths: 1, 5, 40 and 12 tokens (vocabulary 64).
PROMPTS = [torch.tensor([1]), torch.tensor([1, 5, 9, 2, 7]), torch.arange(3, 43) % 64, torch.arange(20, 32)]


def target_and_head(kind: str, decode_linears: bool) -> tuple[NativeLM, object]:
    lm = native_lm()
    head = random_head(lm, EXIT, kind)  # before decode linears replace the weights it copies
    return (NativeLM(lm.model) if decode_linears else lm), head


def engine_for(lm, head, rows: int, k: int = 3) -> BatchEngine:
    return make_batch_engine(lm, method="early-exit", drafter=BatchedEarlyExit(lm, head, rows, 200), max_batch_size=rows,
                       max_len=100, num_speculative_tokens=k)


def steps_of(engine: BatchEngine, jobs, start=None, cancel=None) -> dict[int, list[tuple[list[int], int]]]:
    """Each job's (tokens, drafted) per step. ``jobs``: (prompt, params, budget); ``start``
    {job: step} delays a job's ``add`` (default: step 0); ``cancel`` {job: step} drops it."""
    start, cancel = start or {}, cancel or {}
    ids: dict[int, int] = {}
    per_job: dict[int, list] = {i: [] for i in range(len(jobs))}
    step = 0
    while engine.active or len(ids) < len(jobs):
        for i, (prompt, params, budget) in enumerate(jobs):
            if i not in ids.values() and start.get(i, 0) == step:
                ids[engine.add(prompt, params, StopConditions(budget))] = i
        for row, i in ids.items():
            if cancel.get(i) == step:
                engine.cancel(row)
        for row, update in engine.step().items():
            per_job[ids[row]].append((update.tokens, update.drafted))
        step += 1
    return per_job


def tokens(steps) -> list[int]:
    return [t for emitted, _ in steps for t in emitted]


def plain(lm, prompt, budget) -> list[int]:
    return [t for s in decode(lm, prompt, StopConditions(budget), drafter=NoDrafter()) for t in s.tokens]


@pytest.mark.parametrize("decode_linears", [False, True])
@pytest.mark.parametrize("kind", ["shared", "trained", "extra-block"])
def test_draft_pass_logits_do_not_depend_on_the_batch(kind, decode_linears):
    """Bit for bit: a row's exit-head logits alone equal its logits next to any other rows
    (plain linears: canonical shapes; decode linears: the head gets them too)."""
    lm, head = target_and_head(kind, decode_linears)
    drafter = BatchedEarlyExit(lm, head, 4, 64)
    for slot, prompt in enumerate(PROMPTS):
        drafter.forward([Feed(slot, 0, prompt, 0)])
    widths = [1, 5, 3, 2]

    def feed(slot):
        return Feed(slot, PROMPTS[slot].numel(), torch.arange(3, 3 + widths[slot]), widths[slot])

    alone = {s: drafter.forward([feed(s)])[0] for s in range(4)}
    for group in ([0, 1], [1, 2, 3], [3, 0, 2, 1], [2, 0]):
        for s, logits in zip(group, drafter.forward([feed(s) for s in group])):
            assert torch.equal(logits, alone[s]), (group, s)


@pytest.mark.parametrize("kind,decode_linears", [("shared", False), ("trained", False), ("extra-block", False),
                                                 ("trained", True)])
def test_greedy_rows_equal_plain_decoding_and_draft_as_alone(kind, decode_linears):
    """Four rows (a slot of three freed and reused by the fourth, joining mid-way), each
    token for token plain greedy decoding; each step's drafted count is the one it gets
    alone, so the batched drafts themselves do not depend on the batch."""
    lm, head = target_and_head(kind, decode_linears)
    budgets = [20, 5, 20, 14]  # rows finish at different steps; job 1's slot goes to job 3
    jobs = [(p, SamplingParams(), n) for p, n in zip(PROMPTS, budgets)]
    together = steps_of(engine_for(lm, head, 3), jobs, start={3: 7})
    accepted = 0
    for i, (prompt, _, budget) in enumerate(jobs):
        assert tokens(together[i]) == plain(lm, prompt, budget), (kind, i)
        assert together[i] == steps_of(engine_for(lm, head, 1), [jobs[i]])[0], (kind, i)
        accepted += sum(drafted for _, drafted in together[i])
    assert accepted > 0  # the head drafts tokens the target keeps: the drafts were used


def test_seeded_sampled_rows_reproduce_their_solo_output():
    lm, head = target_and_head("trained", False)
    params = [SamplingParams(0.8, seed=1), SamplingParams(1.0, top_p=0.9, seed=2), SamplingParams(),
              SamplingParams(0.6, top_k=20, seed=3)]
    jobs = [(p, s, 16) for p, s in zip(PROMPTS, params)]
    together = steps_of(engine_for(lm, head, 4), jobs, start={1: 2})
    for i, job in enumerate(jobs):
        assert together[i] == steps_of(engine_for(lm, head, 1), [job])[0], i


def test_freed_slots_are_reused_losslessly():
    """A long row is cancelled and a short finishes; new rows take their slots, whose
    cache rows (the drafter's and the target's) hold the old rows' stale keys."""
    lm, head = target_and_head("extra-block", False)
    jobs = [(PROMPTS[2], SamplingParams(), 20), (PROMPTS[1], SamplingParams(), 3),
            (PROMPTS[0], SamplingParams(), 12), (PROMPTS[3], SamplingParams(), 12)]
    engine = engine_for(lm, head, 2)
    out = steps_of(engine, jobs, start={2: 3, 3: 6}, cancel={0: 2})
    assert engine.free_slots == 2
    for i in (2, 3):
        assert tokens(out[i]) == plain(lm, jobs[i][0], jobs[i][2]), i
        assert out[i] == steps_of(engine_for(lm, head, 1), [jobs[i]])[0], i


@pytest.mark.parametrize("decode_linears", [False, True])
def test_a_joining_row_takes_its_draft_prefill_from_the_target_pass(decode_linears, monkeypatch):
    """The drafter never runs layers [0, L) over a joining row's prompt itself: the row's
    first step (the target's prefill) drafts nothing and leaves the drafter what its own
    prefill would have computed (its cache rows, the extra block's too); the next steps draft."""
    lm, head = target_and_head("extra-block", decode_linears)
    engine = engine_for(lm, head, 2)
    drafter = engine.drafter
    monkeypatch.setattr(drafter, "_prefill", lambda *a: pytest.fail("the drafter prefilled a row itself"))
    prompt = PROMPTS[2]
    row = engine.add(prompt, SamplingParams(), StopConditions(20))
    first = engine.step()[row]
    assert first.drafted == 0 and engine.prefill_seconds > 0
    slot, n, exit_layer = 0, prompt.numel(), drafter.adopts_layer
    assert drafter.lengths[slot] == n
    own = BatchedEarlyExit(lm, head, 2, 200)
    own.forward([Feed(slot, 0, prompt, 0)])  # what the drafter's own prefill computes
    for mine, theirs in ((drafter.cache.k, own.cache.k), (drafter.cache.v, own.cache.v),
                         (drafter.head_cache.k, own.head_cache.k), (drafter.head_cache.v, own.head_cache.v)):
        torch.testing.assert_close(mine[:exit_layer, slot, :, :n], theirs[:exit_layer, slot, :, :n])
    drafted = 0
    while engine.active:
        drafted += sum(u.drafted for u in engine.step().values())
    assert drafted > 0


def test_options_choose_the_head_and_layer_and_the_policy_measures_early_exit(private_cache_dir):
    lm = native_lm()
    drafter = make_batch_drafter("early-exit", None, lm, 2, 64, DraftOptions(exit_head="shared", exit_layer=3))
    assert isinstance(drafter, BatchedEarlyExit) and drafter.name == "early-exit(L=3,shared)"
    with pytest.raises(ValueError, match="--exit-layer must be in 1..3"):
        make_batch_drafter("early-exit", None, lm, 2, 64, DraftOptions(exit_layer=4))
    single = EarlyExitDrafter(lm, random_head(lm, EXIT, "trained"))
    method, draft, options = batch_method(single)  # what generate([...]) batches a drafter as
    assert (method, draft, options.exit_head) == ("early-exit", None, single.head)
    engine = make_batch_engine(lm, method=method, options=options, max_batch_size=2, max_len=60)
    assert engine.drafter.name == "early-exit(L=2,trained)" and engine.policy.calibrations[0].draft  # its draft step, measured
    out = steps_of(engine, [(p, SamplingParams(), 10) for p in PROMPTS[:2]])
    assert [tokens(out[0]), tokens(out[1])] == [plain(lm, p, 10) for p in PROMPTS[:2]]


def test_server_runs_early_exit_on_the_batched_engine():
    from quickdraft.server.cli import make_engine

    lm = native_lm()
    engine = make_engine("batch", lm, "early-exit", None, 2, 3, True, DraftOptions(exit_head="shared", exit_layer=1),
                         "mss")
    assert engine.name == "batch" and isinstance(engine.drafter, BatchedEarlyExit)


def test_prompts_file_with_early_exit_prints_what_ar_prints(tiny_family, tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "def add(a, b):"}, {"prompt": "x", "max_new_tokens": 5},
             {"prompt": "for i in range(10):\n    print(i, i * i)\n" * 3}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    common = ["generate", "--model", str(tiny_family["target"]), "--max-new-tokens", "12", "--prompts-file", str(path)]
    assert main([*common, "--method", "early-exit", "--draft", "shared", "--exit-layer", "1", "-k", "3",
                 "--batch-size", "2"]) == 0
    early = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main([*common, "--method", "ar"]) == 0
    ar = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["token_ids"] for r in early] == [r["token_ids"] for r in ar]
    assert all(r["settings"]["method"] == "early-exit" for r in early)
