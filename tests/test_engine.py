"""Greedy speculative decoding must reproduce plain greedy decoding token for token."""

import pytest
import torch

from quickdraft.decoding.engine import decode
from quickdraft.decoding.stats import GenerationStats
from quickdraft.decoding.stopping import StopConditions
from quickdraft.decoding.verify import GreedyAcceptance
from quickdraft.drafters import DraftModelDrafter
from quickdraft.generator import SpeculativeGenerator
from quickdraft.models import cpu_kernels
from quickdraft.models.lm import load_model
from quickdraft.pair import load_tokenizer

PROMPTS = ["def add(a, b):", "class Point:\n    def", "x", "for i in range(10):\n    print(i"]


def plain(target, tok, prompt, n, eos=()):
    ids = torch.tensor(tok(prompt)["input_ids"]) if isinstance(prompt, str) else prompt
    return [t for s in decode(target, ids, StopConditions(n, eos)) for t in s.tokens]


def spec(target, draft, tok, prompt, n, k, eos=(), stats=None):
    ids = torch.tensor(tok(prompt)["input_ids"]) if isinstance(prompt, str) else prompt
    drafter = DraftModelDrafter(draft, target.vocab_size)
    steps = decode(target, ids, StopConditions(n, eos), drafter=drafter, num_speculative_tokens=k, stats=stats)
    return [t for s in steps for t in s.tokens]


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("draft_name", ["copy", "perturbed", "unrelated"])
def test_greedy_speculative_equals_plain(models, draft_name, k):
    tok, target, drafts = models
    for prompt in PROMPTS:
        reference = plain(target, tok, prompt, 40)
        assert spec(target, drafts[draft_name], tok, prompt, 40, k) == reference, (prompt, k)


def test_prompt_of_one_token(models):
    tok, target, drafts = models
    prompt = torch.tensor([7])
    reference = plain(target, tok, prompt, 25)
    for k in (1, 3, 8):
        assert spec(target, drafts["perturbed"], tok, prompt, 25, k) == reference


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 11])
def test_max_new_tokens_inside_a_chunk(models, n):
    tok, target, drafts = models
    stats = GenerationStats()
    out = spec(target, drafts["copy"], tok, PROMPTS[0], n, 8, stats=stats)
    assert out == plain(target, tok, PROMPTS[0], n)
    assert len(out) == n and stats.new_tokens == n and stats.finish_reason == "length"


def test_eos_inside_an_accepted_chunk(models):
    tok, target, drafts = models
    reference = plain(target, tok, PROMPTS[1], 30)
    # Declare the token plain decoding emits at position 6 to be EOS: the copy draft proposes
    # it in the middle of a fully accepted chunk, and generation must stop right before it.
    eos = reference[6]
    expected = reference[: reference.index(eos)]
    for k in (3, 5, 8):
        stats = GenerationStats()
        out = spec(target, drafts["copy"], tok, PROMPTS[1], 30, k, eos=[eos], stats=stats)
        assert out == expected == plain(target, tok, PROMPTS[1], 30, eos=[eos])
        assert stats.finish_reason == "stop"


def test_stats_count_only_the_accepted_drafts_eos_leaves(models):
    """A chunk cut at EOS counts only the accepted drafts before the cut: an EOS as the first
    draft token used to give "0 tokens ... acceptance 50% (2/4)"."""
    tok, target, drafts = models
    reference = plain(target, tok, PROMPTS[1], 30)
    for position in (0, 2):
        eos = reference[position]
        cut = reference.index(eos)  # the copy draft's first chain (k=5) is reference[:5], all accepted
        stats = GenerationStats()
        out = spec(target, drafts["copy"], tok, PROMPTS[1], 30, 5, eos=[eos], stats=stats)
        assert len(out) == stats.new_tokens == cut and stats.target_forward_passes == 1
        assert stats.drafted_tokens == 5 and stats.accepted_tokens == cut, stats
        assert stats.accepted_per_position == [1] * cut + [0] * (5 - cut)
        assert stats.prefill_tokens == cut and stats.decode_tokens == 0
        assert (stats.finish_reason, stats.stopped_by) == ("stop", "eos")
        summary = stats.summary()
        assert summary.startswith(f"{cut} tokens (ended at EOS) in ") and f"({cut}/5)" in summary


def test_stats_say_what_ended_the_generation(models):
    tok, target, drafts = models
    stats = GenerationStats()
    spec(target, drafts["copy"], tok, PROMPTS[0], 7, 4, stats=stats)
    assert (stats.finish_reason, stats.stopped_by) == ("length", "max_new_tokens")
    assert "ended" not in stats.summary()  # the token count says it


def test_stats_are_consistent(models):
    tok, target, drafts = models
    stats = GenerationStats()
    out = spec(target, drafts["copy"], tok, PROMPTS[0], 41, 4, stats=stats)
    assert stats.new_tokens == len(out) == 41
    assert stats.acceptance_rate == 1.0  # an exact copy is always right
    # The prefill pass verifies a draft too: 8 passes of k+1 = 5 tokens, then the budget
    # leaves room for one token only, which a pass without draft gives.
    assert stats.target_forward_passes == 9 and stats.decode_passes == 8
    assert stats.mean_accepted_tokens == 41 / 9
    assert stats.drafted_per_position == [8] * 4 and stats.per_position_acceptance == [1.0] * 4
    plain_stats = GenerationStats()
    list(decode(target, torch.tensor([3, 4]), StopConditions(20), stats=plain_stats))
    assert plain_stats.mean_accepted_tokens == 1.0 and plain_stats.target_forward_passes == 20
    d = stats.to_dict()
    for key in ("new_tokens", "target_forward_passes", "drafted_tokens", "accepted_tokens", "acceptance_rate",
                "mean_accepted_tokens", "per_position_acceptance", "prefill_seconds", "decode_seconds",
                "tokens_per_second", "time_to_first_token"):
        assert key in d


def test_stop_string_inside_a_chunk_matches_plain(tiny_family):
    ar = SpeculativeGenerator.from_pretrained(tiny_family["target"], method="ar")
    sd = SpeculativeGenerator.from_pretrained(tiny_family["target"], draft=tiny_family["copy"])
    full = ar.generate(PROMPTS[0], max_new_tokens=30)
    stop = full.text[10:13]  # some text plain decoding produces mid-way
    a = ar.generate(PROMPTS[0], max_new_tokens=30, stop=[stop])
    b = sd.generate(PROMPTS[0], max_new_tokens=30, stop=[stop], num_speculative_tokens=8)
    assert a.token_ids == b.token_ids and a.text == b.text
    assert stop not in a.text and full.text.startswith(a.text)
    assert a.stats.finish_reason == "stop" and len(a.token_ids) < 30
    streamed = "".join(c.text for c in sd.stream(PROMPTS[0], max_new_tokens=30, stop=[stop], num_speculative_tokens=8))
    assert streamed == b.text


def test_stream_concatenates_to_generate_and_marks_drafts(tiny_family):
    sd = SpeculativeGenerator.from_pretrained(tiny_family["target"], draft=tiny_family["copy"])
    full = sd.generate(PROMPTS[2], max_new_tokens=30, num_speculative_tokens=4)
    chunks = list(sd.stream(PROMPTS[2], max_new_tokens=30, num_speculative_tokens=4))
    assert "".join(c.text for c in chunks) == full.text
    assert any(from_draft for c in chunks for _, from_draft in c.segments)
    assert len(chunks) < 30  # several tokens per chunk: accepted tokens come out together


def test_kv_rollback_gives_fresh_logits(tiny_family):
    """Extending, cropping and extending again equals computing the final sequence afresh."""
    lm = load_model(tiny_family["target"])
    fresh = load_model(tiny_family["target"])
    lm.reset(64)
    lm.extend(torch.tensor([1, 2, 3, 4, 5]))
    lm.extend(torch.tensor([9, 9, 9]))  # rejected proposals
    lm.crop(5)
    got = lm.extend(torch.tensor([6, 7]))
    fresh.reset(64)
    want = fresh.extend(torch.tensor([1, 2, 3, 4, 5, 6, 7]))[-2:]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_hf_backend_decodes_like_native(tiny_family):
    tok = load_tokenizer(tiny_family["target"])
    native, hf = load_model(tiny_family["target"]), load_model(tiny_family["target"], backend="hf")
    assert hf.backend == "hf" and native.backend == "native"
    assert plain(hf, tok, PROMPTS[0], 20) == plain(native, tok, PROMPTS[0], 20)
    # The generic backend also serves as target and draft (cache cropping).
    hf_draft = load_model(tiny_family["perturbed"], backend="hf")
    assert spec(hf, hf_draft, tok, PROMPTS[0], 20, 4) == plain(native, tok, PROMPTS[0], 20)


def plain_run(target, ids, n, eos=(), chains=True, monkeypatch=None, **kwargs):
    """Plain decoding's steps and stats, in greedy chains of engine.PLAIN_CHAIN or (``chains``
    False) one pass a token."""
    from quickdraft.decoding import engine

    monkeypatch.setattr(engine, "PLAIN_CHAIN", engine.PLAIN_CHAIN if chains else 1)
    stats = GenerationStats()
    steps = list(decode(target, ids, StopConditions(n, eos), stats=stats, **kwargs))
    monkeypatch.undo()
    return steps, stats


@pytest.mark.skipif(cpu_kernels.library() is None, reason="needs our compiled CPU kernels (x86 AVX2, a C compiler)")
def test_plain_greedy_chains_decode_what_one_pass_a_token_does(models, monkeypatch):
    """Plain greedy decoding settles up to PLAIN_CHAIN tokens a call of the target's greedy
    chain (one C call): the tokens, pass counts and finish of one pass a token, wherever the
    text ends: the token budget inside or at the end of a chain, EOS inside one (the chain
    ends there), the context. Sampling, and an acceptance rule of the caller's, step."""
    from quickdraft.decoding.engine import PLAIN_CHAIN
    from quickdraft.decoding.sampling import SamplingParams
    from quickdraft.models.lm import NativeLM

    tok, target, _ = models
    calls = []
    real = NativeLM.greedy_chain

    def counted(self, *args, **kwargs):
        tokens = real(self, *args, **kwargs)
        calls.append(None if tokens is None else len(tokens))
        return tokens

    ids = torch.tensor(tok(PROMPTS[1])["input_ids"])
    reference = [t for s in plain_run(target, ids, 40, chains=False, monkeypatch=monkeypatch)[0] for t in s.tokens]
    cases = [dict(n=n) for n in (1, 2, 7, 8, 9, 17, 40)]
    cases += [dict(n=40, eos=[reference[i]]) for i in (0, 1, 5, 12)]
    context = target.context_length
    long_prompt = ids.repeat(context // ids.numel() + 1)[: context - 11]
    for case in cases + [dict(n=40, prompt=long_prompt)]:
        prompt = case.get("prompt", ids)
        want_steps, want = plain_run(target, prompt, case["n"], case.get("eos", ()), chains=False,
                                     monkeypatch=monkeypatch)
        monkeypatch.setattr(NativeLM, "greedy_chain", counted)
        calls.clear()
        got_steps, got = plain_run(target, prompt, case["n"], case.get("eos", ()), monkeypatch=monkeypatch)
        tokens = [t for s in got_steps for t in s.tokens]
        assert tokens == [t for s in want_steps for t in s.tokens], case
        for key in ("new_tokens", "prefill_tokens", "target_forward_passes", "finish_reason", "stopped_by",
                    "drafted_tokens", "accepted_tokens"):
            assert getattr(got, key) == getattr(want, key), (case, key)
        longest = min(PLAIN_CHAIN, len(tokens) - 1) if len(tokens) > 1 else len(tokens)
        assert max((len(s.tokens) for s in got_steps), default=0) == longest, case
        assert all(c is not None for c in calls)
        if case == dict(n=40):  # after the prefill's token, chains up to the budget
            assert calls == [PLAIN_CHAIN] * (39 // PLAIN_CHAIN) + [39 % PLAIN_CHAIN]
    assert want.stopped_by == "context" and len(tokens) == 11
    eos = reference[5]
    _, stats = plain_run(target, ids, 40, [eos], monkeypatch=monkeypatch)
    assert stats.target_forward_passes == reference.index(eos) + 1  # nothing computed after EOS
    monkeypatch.setattr(NativeLM, "greedy_chain", counted)
    calls.clear()
    sampled = SamplingParams(temperature=0.8, seed=1)
    plain_run(target, ids, 20, params=sampled, monkeypatch=monkeypatch)
    monkeypatch.setattr(NativeLM, "greedy_chain", counted)
    rule = GreedyAcceptance()
    plain_run(target, ids, 20, acceptance=lambda proposal, logits: rule(proposal, logits), monkeypatch=monkeypatch)
    assert calls == []
