"""The server's solo engine (rows stepped in turn through the one decode loop), without a
server: each row's output is its lone generation's, whatever else runs."""

from __future__ import annotations

import pytest
import torch

from quickdraft.decoding.sampling import SamplingParams
from quickdraft.decoding.step import ContextOverflowError
from quickdraft.decoding.stopping import StopConditions
from quickdraft.drafters import DraftOptions
from quickdraft.generator import SpeculativeGenerator
from quickdraft.models.lm import load_model
from quickdraft.server.solo_engine import BatchFullError, SoloEngine

PROMPTS = ["def add(a, b):", "for i in range(10):\n    print(i", "class Point:\n    def __init__(self, x, y):", "x"]


def run_rows(engine, tok, jobs, join_at=None):
    """Run (prompt, params, max_new) jobs; the job at index ``join_at[0]`` joins after
    ``join_at[1]`` steps. Returns {job index: (tokens, finish, stats)} and the steps taken."""
    waiting = list(enumerate(jobs))
    late = waiting.pop(join_at[0]) if join_at else None
    rows, out, steps = {}, {}, 0
    while waiting or engine.active or late:
        if late and steps >= join_at[1]:
            waiting.append(late)
            late = None
        while waiting and engine.free_slots:
            i, (prompt, params, max_new) = waiting.pop(0)
            ids = torch.tensor(tok(prompt)["input_ids"])
            rows[engine.add(ids, params, StopConditions(max_new, [tok.eos_token_id]))] = i
            out[i] = [[], None, None]
        for row, update in engine.step().items():
            out[rows[row]][0] += update.tokens
            if update.finish:
                out[rows[row]][1:] = [update.finish, update.stats]
        steps += 1
    return out, steps


@pytest.mark.parametrize("method", ["draft", "tree", "ngram"])
def test_rows_equal_their_lone_generation_greedy_and_seeded(models, method):
    tok, target, drafts = models
    draft = drafts["perturbed"]
    options = DraftOptions(tree="2,1")
    engine = SoloEngine(target, method=method, draft=draft, max_batch_size=2, num_speculative_tokens=3,
                        options=options)
    jobs = [(PROMPTS[0], SamplingParams(), 9), (PROMPTS[1], SamplingParams(0.9, seed=4), 17),
            (PROMPTS[2], SamplingParams(), 30), (PROMPTS[3], SamplingParams(1.0, top_p=0.9, seed=1), 5)]
    out, _ = run_rows(engine, tok, jobs, join_at=(3, 2))
    from quickdraft.drafters import make_drafter

    lone = SpeculativeGenerator(target, tok, make_drafter(method, draft, target.vocab_size, options),
                                num_speculative_tokens=3)
    for i, (prompt, params, max_new) in enumerate(jobs):
        ref = lone.generate(prompt, max_new_tokens=max_new, sampling=params)
        tokens, finish, stats = out[i]
        assert tokens == ref.token_ids, (method, i)
        assert finish == ref.stats.finish_reason and stats.new_tokens == len(tokens)
        assert stats.target_forward_passes == ref.stats.target_forward_passes
    assert engine.active == 0 and engine.free_slots == 2 and engine.kv_cache_bytes == 0


def test_transformers_backend_rows(tiny_family):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_family["target"])
    target, draft = load_model(tiny_family["target"], "hf"), load_model(tiny_family["perturbed"], "hf")
    engine = SoloEngine(target, method="draft", draft=draft, max_batch_size=3, num_speculative_tokens=2)
    out, _ = run_rows(engine, tok, [(p, SamplingParams(), 8) for p in PROMPTS[:3]])
    plain = SpeculativeGenerator(target, tok)
    for i, prompt in enumerate(PROMPTS[:3]):
        assert out[i][0] == plain.generate(prompt, max_new_tokens=8).token_ids
    assert engine.kv_cache_bytes == 0


def test_limits_cancel_and_a_generation_that_ends_at_once(models):
    tok, target, drafts = models
    engine = SoloEngine(target, method="draft", draft=drafts["copy"], max_batch_size=2, num_speculative_tokens=2)
    ids = torch.tensor(tok(PROMPTS[0])["input_ids"])
    with pytest.raises(ContextOverflowError):
        engine.add(torch.zeros(target.context_length, dtype=torch.long), SamplingParams(), StopConditions(4))
    a = engine.add(ids, SamplingParams(), StopConditions(50))
    b = engine.add(ids, SamplingParams(), StopConditions(50))
    with pytest.raises(BatchFullError):
        engine.add(ids, SamplingParams(), StopConditions(4))
    assert set(engine.step()) == {a, b} and engine.kv_cache_bytes > 0
    engine.cancel(a)
    assert engine.active == 1 and set(engine.step()) == {b}
    engine.cancel(b)
    engine.cancel(b)  # twice is harmless
    assert engine.active == 0 and engine.kv_cache_bytes == 0 and engine.step() == {}
    # The first token is an end token: one update, no tokens, finish "stop".
    first = SpeculativeGenerator(target, tok).generate(PROMPTS[0], max_new_tokens=1).token_ids[0]
    row = engine.add(ids, SamplingParams(), StopConditions(5, [first]))
    assert [(u.tokens, u.finish) for u in engine.step().values()] == [([], "stop")]
    assert engine.active == 0 and row not in engine.step()


def test_k_zero_decodes_plainly(models):
    """k=0 (the cost model's "the draft loses") means plain decoding, as in `generate`, not
    the default k: no draft token is proposed, and the output is plain greedy decoding's."""
    tok, target, drafts = models
    engine = SoloEngine(target, method="draft", draft=drafts["perturbed"], max_batch_size=1,
                        num_speculative_tokens=0)
    assert engine.num_speculative_tokens == 0
    out, _ = run_rows(engine, tok, [(PROMPTS[0], SamplingParams(), 12)])
    tokens, _, stats = out[0]
    assert tokens == SpeculativeGenerator(target, tok).generate(PROMPTS[0], max_new_tokens=12).token_ids
    assert stats.drafted_tokens == 0 and stats.target_forward_passes == len(tokens)
