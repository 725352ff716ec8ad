"""Greedy EAGLE, hybrid-eagle, prompt-lookup, draft-model and hybrid rounds in one C call (``drafter.greedy_rounds``,
``qd_spec_rounds``): the engine settles up to ``engine.SPEC_CHUNK`` tokens a call, and
gives the tokens, the per-round stats and the finish of its round-by-round loop wherever
the text ends (the token budget, EOS inside a chunk, the context), for the embedded pair's
drafters (its EAGLE drafter maps the target's states, its draft model a restricted head)
and SmolLM2's EAGLE drafter (which reads the states as they are).
Sampling and a caller's acceptance rule go round by round."""

from __future__ import annotations

import pytest
import torch
from smollm2 import NEEDS_SMOLLM2

from quickdraft.decoding import engine
from quickdraft.decoding.engine import decode
from quickdraft.decoding.sampling import SamplingParams
from quickdraft.decoding.stats import GenerationStats
from quickdraft.decoding.stopping import StopConditions
from quickdraft.decoding.verify import GreedyAcceptance
from quickdraft.generator import SpeculativeGenerator
from quickdraft.models import cpu_kernels
from quickdraft.models.lm import NativeLM

# Code that repeats itself (prompt lookup's rounds) and prose (the drafter's).
PROMPTS = ["class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
           "        self.items.append(item)\n\n    def pop(self",
           "The history of the city begins"]
METHODS = ("eagle", "hybrid-eagle", "ngram", "draft", "hybrid")
STATS = ("new_tokens", "target_forward_passes", "drafted_tokens", "accepted_tokens", "drafted_per_position",
         "accepted_per_position", "finish_reason", "stopped_by")

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="needs our compiled CPU kernels (x86 AVX2, a C compiler)")


def run(gen, ids, n, eos=(), k=4, one_call=True, monkeypatch=None, **kwargs):
    """The steps and stats of ``gen``'s drafter decoding ``ids``: its C rounds, or (``one_call``
    False, SPEC_CHUNK 0) the engine's round-by-round loop."""
    monkeypatch.setattr(engine, "SPEC_CHUNK", engine.SPEC_CHUNK if one_call else 0)
    drafter = getattr(gen.drafter, "model", gen.drafter)  # (hybrid-eagle's EAGLE drafter)
    if getattr(drafter, "features", None) is not None:  # no states left from the run before (the same text's)
        with torch.inference_mode():
            drafter.features.zero_()
    stats = GenerationStats()
    steps = list(decode(gen.target, ids, StopConditions(n, eos), drafter=gen.drafter, num_speculative_tokens=k,
                        stats=stats, **kwargs))
    monkeypatch.undo()
    return steps, stats


def counting(monkeypatch, calls: list) -> None:
    real = NativeLM.spec_rounds

    def counted(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls.append(None if out is None else sum(r[2] for r in out.rounds))
        return out

    monkeypatch.setattr(NativeLM, "spec_rounds", counted)


def assert_rounds_match(gen, monkeypatch, cases, k):
    for case in cases:
        prompt = case.get("prompt")
        ids = prompt if prompt is not None else torch.tensor(gen.tokenizer(case["text"])["input_ids"])
        want_steps, want = run(gen, ids, case["n"], case.get("eos", ()), k, one_call=False, monkeypatch=monkeypatch)
        calls: list = []
        counting(monkeypatch, calls)
        got_steps, got = run(gen, ids, case["n"], case.get("eos", ()), k, monkeypatch=monkeypatch)
        assert [s.tokens for s in got_steps] == [s.tokens for s in want_steps], case
        assert [s.drafted for s in got_steps] == [s.drafted for s in want_steps], case
        for key in STATS:
            assert getattr(got, key) == getattr(want, key), (case, key)
        if case["n"] > 2 * engine.SPEC_CHUNK and not case.get("eos") and "prompt" not in case:  # C rounds, a chunk a call
            assert calls and all(c is not None for c in calls), case
            assert max(calls) >= engine.SPEC_CHUNK and sum(calls) > case["n"] // 2, case


@pytest.fixture(scope="module")
def embedded():
    return {m: SpeculativeGenerator.from_pretrained(method=m) for m in METHODS}


@pytest.mark.parametrize("method", METHODS)
def test_c_rounds_decode_what_the_loop_does(embedded, method, monkeypatch):
    gen = embedded[method]
    ids = torch.tensor(gen.tokenizer(PROMPTS[0])["input_ids"])
    reference = [t for s in run(gen, ids, 60, one_call=False, monkeypatch=monkeypatch)[0] for t in s.tokens]
    cases = [dict(text=text, n=n) for text in PROMPTS for n in (1, 2, 5, 17, 60)]
    cases += [dict(text=PROMPTS[0], n=60, eos=[reference[i]]) for i in (0, 3, 20, 41)]
    context = gen.target.context_length
    cases.append(dict(prompt=ids.repeat(context // ids.numel() + 1)[: context - 23], n=60))
    assert_rounds_match(gen, monkeypatch, cases, k=5)


def test_sampling_and_a_callers_rule_go_round_by_round(embedded, monkeypatch):
    gen = embedded["hybrid-eagle"]
    ids = torch.tensor(gen.tokenizer(PROMPTS[0])["input_ids"])
    calls: list = []
    counting(monkeypatch, calls)
    list(decode(gen.target, ids, StopConditions(30), drafter=gen.drafter, num_speculative_tokens=4,
                params=SamplingParams(temperature=0.8, seed=1)))
    rule = GreedyAcceptance()
    list(decode(gen.target, ids, StopConditions(30), drafter=gen.drafter, num_speculative_tokens=4,
                acceptance=lambda proposal, logits: rule(proposal, logits)))
    assert calls == []


@NEEDS_SMOLLM2[0]
@NEEDS_SMOLLM2[1]
@pytest.mark.parametrize("method", ["eagle", "hybrid-eagle"])
def test_smollm2_c_rounds_decode_what_the_loop_does(method, monkeypatch):
    gen = SpeculativeGenerator.from_pretrained("smollm2-135m", method=method)
    cases = [dict(text=text, n=n) for text in PROMPTS for n in (3, 64)]
    assert_rounds_match(gen, monkeypatch, cases, k=6)


def stop_policy_of(drafter):
    from quickdraft.drafters.hybrid import HybridDrafter

    chain = drafter.model if isinstance(drafter, HybridDrafter) else drafter
    return getattr(chain, "stop_policy", None) or chain.stop


@pytest.mark.parametrize("method,stop", [("eagle", "confidence:0.4"), ("eagle", "dv"), ("eagle", "heuristic"),
                                         ("draft", "dv:start=0.05,max=3"), ("draft", "heuristic"), ("hybrid-eagle", "dv"),
                                         ("hybrid", "heuristic")])
def test_c_rounds_apply_a_draft_stop_policy_as_the_loop_does(method, stop, monkeypatch):
    """--draft-stop confidence, dv and heuristic in the C rounds: the chains' lengths, the
    tokens and stats of the round-by-round loop, and the policy's state after them (dv's
    threshold and acceptance, heuristic's n) the same to the bit."""
    from copy import deepcopy

    from quickdraft.drafters import DraftOptions

    gen = SpeculativeGenerator.from_pretrained(method=method, options=DraftOptions(draft_stop=stop))
    policy = stop_policy_of(gen.drafter)
    assert policy.name.startswith(stop.partition(":")[0])
    for text, n in ((PROMPTS[0], 60), (PROMPTS[1], 60), (PROMPTS[1], 5)):
        ids = torch.tensor(gen.tokenizer(text)["input_ids"])
        start = deepcopy(policy.__dict__)
        want_steps, want = run(gen, ids, n, k=5, one_call=False, monkeypatch=monkeypatch)
        after_loop = deepcopy(policy.__dict__)
        policy.__dict__.update(deepcopy(start))
        calls: list = []
        counting(monkeypatch, calls)
        got_steps, got = run(gen, ids, n, k=5, monkeypatch=monkeypatch)
        assert [s.tokens for s in got_steps] == [s.tokens for s in want_steps], (text, n)
        assert [s.drafted for s in got_steps] == [s.drafted for s in want_steps], (text, n)
        for key in STATS:
            assert getattr(got, key) == getattr(want, key), (text, n, key)
        assert policy.__dict__ == after_loop, (text, n)
        if n > 2 * engine.SPEC_CHUNK:  # the rounds ran in C, a chunk a call
            assert calls and all(c is not None for c in calls) and max(calls) >= engine.SPEC_CHUNK, calls
            drafted = want.drafted_per_position  # and the policy set the chains' lengths: not all k = 5 long
            assert len(drafted) < 5 or drafted[0] > drafted[-1], drafted


def test_c_rounds_of_a_drafter_fusing_layers_decode_what_the_loop_does(embedded, monkeypatch):
    """An EAGLE-3 drafter (target layers 3, 6 and the final 8 fused) in the C rounds: the
    target's pass hands out layers 3's and 6's states beside the final one (qd_spec_rounds'
    taps), and the tokens, chains and stats are the loop's. Its map's columns for the new
    layers are random, so the drafts depend on those states."""
    from quickdraft.drafters import DraftOptions
    from quickdraft.drafters.eagle import shipped_eagle
    from quickdraft.models.decode_linear import use_decode_linears
    from quickdraft.models.eagle import EagleHead, load_eagle
    from quickdraft.models.quant_linear import quantize_drafter
    from quickdraft.train.heads import widened_map

    target = embedded["eagle"].target
    shipped = load_eagle(shipped_eagle(target), target.model)  # float32 (serving quantizes it)
    layers = (3, 6, target.config.n_layers)
    fused = EagleHead(target.model, shipped.vocab_ids, shipped.layer_shape, layers).eval()
    state = fused.state_dict()
    state.update((k, v) for k, v in shipped.state_dict().items() if k != "feature_in.weight")
    torch.manual_seed(0)
    weight = widened_map(shipped, layers)
    size = weight.shape[1] // len(layers)
    weight[:, : 2 * size] = torch.randn(weight.shape[0], 2 * size) * weight[:, 2 * size :].std()
    state["feature_in.weight"] = weight
    fused.load_state_dict(state)
    quantize_drafter(fused, beside=target.model)  # as serving loads it (the C chain's linears)
    if target.decode_linears:
        use_decode_linears(fused)
    gen = SpeculativeGenerator.for_pair(target, None, embedded["eagle"].tokenizer, "eagle", DraftOptions(heads=fused))
    ids = torch.tensor(gen.tokenizer(PROMPTS[0])["input_ids"])
    reference = [t for s in run(gen, ids, 60, one_call=False, monkeypatch=monkeypatch)[0] for t in s.tokens]
    cases = [dict(text=text, n=n) for text in PROMPTS for n in (2, 17, 60)]
    cases += [dict(text=PROMPTS[0], n=60, eos=[reference[i]]) for i in (3, 41)]
    assert_rounds_match(gen, monkeypatch, cases, k=5)
