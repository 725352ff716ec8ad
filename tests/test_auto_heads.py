"""``--method auto`` weighs the head methods shipped for the target: measured by running
them (their proposals cannot be replayed from ranks), priced with the same step costs as
the draft methods, and a chosen head method resolves to its loaded heads, lossless."""

from __future__ import annotations

import torch

from quickdraft.decoding.engine import decode
from quickdraft.decoding.stats import GenerationStats
from quickdraft.decoding.stopping import StopConditions
from quickdraft.generator import SpeculativeGenerator
from quickdraft.policy import method_choice
from quickdraft.policy.cost_model import StepCosts
from quickdraft.policy.head_choice import measure_head_method, shipped_head_methods
from quickdraft.policy.method_choice import MethodChoice, choose_method
from quickdraft.resolve import resolve_method

PROMPTS = ["def add(a, b):\n    return", "import os\n\ndef main():\n    path = os.path."]


def embedded():
    gen = SpeculativeGenerator.from_pretrained(method="ar")
    ids = [torch.tensor(gen.tokenizer(p)["input_ids"]) for p in PROMPTS]
    outputs = [[t for s in decode(gen.target, i, StopConditions(32, [])) for t in s.tokens] for i in ids]
    return gen, ids, outputs


def test_every_shipped_head_method_is_measured_with_the_engines_passes():
    gen, ids, outputs = embedded()
    heads = shipped_head_methods(gen.target)
    assert set(heads) == {"medusa", "prophet", "eagle"}
    # auto's cache key names the weights, not only the directory: a head retrained under its
    # old name is weighed again (session 24 retrained the shipped EAGLE drafters in place),
    # and its draft vocabulary (a new default --draft-vocab changes its costs)
    name, digests = heads["eagle"].split("@")
    assert name == "qd-stdlib-target-eagle" and [len(d) for d in digests.split("+")] == [16, 8]
    # Unit costs: a verify pass of any width costs 1, drafting is measured (> 0).
    costs = StepCosts(t_ar=1.0, t_draft=0.0, verify={n: 1.0 for n in range(1, 40)})
    for method, k in (("eagle", 4), ("prophet", 2), ("hybrid-eagle", 6)):
        speedup, tau = measure_head_method(method, k, gen.target, ids, outputs, costs, repeats=1)
        plan = resolve_method(gen.target, None, gen.tokenizer, method)
        passes = 0
        for prompt, reference in zip(ids, outputs):
            stats = GenerationStats()
            out = [t for s in decode(gen.target, prompt, StopConditions(len(reference), []),
                                     plan.drafter(None, gen.target), num_speculative_tokens=k, stats=stats)
                   for t in s.tokens]
            assert out == reference
            passes += stats.target_forward_passes
        tokens = sum(map(len, outputs))
        assert tau == tokens / passes, method
        # Drafting time is real, so the speedup is below the passes saved, never above.
        assert 0 < speedup < tokens / passes


def test_auto_weighs_the_head_methods_beside_the_draft_methods(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    gen = SpeculativeGenerator.from_pretrained(method="draft")
    choice = choose_method(gen.target, gen.draft, gen.tokenizer, prompts=PROMPTS[:1], new_tokens=24, max_k=4)
    for label in ("medusa k=4", "prophet k=4", "eagle k=6", "eagle k=1 tree=1", "eagle k=2 tree=1,1",
                  "eagle k=3 tree=1,1,1", "hybrid-eagle k=6 tree=1,1",
                  "draft k=4", "tree 2,1"):
        assert label in choice.table
    assert choice.predicted == max(s for s, _ in choice.table.values())


def test_a_chosen_head_method_resolves_to_its_heads_and_stays_lossless(monkeypatch):
    gen, ids, outputs = embedded()
    choice = MethodChoice("eagle", 4, (), 2.0, {"eagle k=4": (2.0, 3.0)})
    monkeypatch.setattr(method_choice, "cached_method", lambda *a, **kw: choice)  # as if auto chose eagle
    plan = resolve_method(gen.target, None, gen.tokenizer, "auto")
    assert plan.method == "eagle" and plan.choice is choice and plan.k == 4
    assert plan.options.heads is not None and plan.label == "auto: eagle"
    auto = SpeculativeGenerator(gen.target, gen.tokenizer, plan.drafter(None, gen.target))
    for prompt, reference in zip(PROMPTS, outputs):
        assert auto.generate(prompt, max_new_tokens=32, num_speculative_tokens=plan.k).token_ids == reference


def test_an_eagle_chain_of_one_resolves_to_its_shape_and_stays_lossless(monkeypatch):
    """Auto's EAGLE-one-token-ahead candidate runs as measured: a chain of 1, not the
    default tree (what auto picks on targets whose verify passes are costly)."""
    gen, ids, outputs = embedded()
    choice = MethodChoice("eagle", 1, (1,), 1.2, {"eagle k=1 tree=1": (1.2, 1.5)})
    assert choice.label == "eagle k=1 tree=1" and choice.options().tree == "1"
    monkeypatch.setattr(method_choice, "cached_method", lambda *a, **kw: choice)
    plan = resolve_method(gen.target, None, gen.tokenizer, "auto")
    assert plan.method == "eagle" and plan.k == 1 and plan.options.tree == "1"
    auto = SpeculativeGenerator(gen.target, gen.tokenizer, plan.drafter(None, gen.target))
    for prompt, reference in zip(PROMPTS, outputs):
        assert auto.generate(prompt, max_new_tokens=32, num_speculative_tokens=plan.k).token_ids == reference


def test_a_chosen_hybrid_eagle_resolves_to_its_chain_and_stays_lossless(monkeypatch):
    """Auto's hybrid-eagle candidate runs as measured: prompt lookup up to k, else the
    shipped EAGLE drafter's chain of 2 (what auto picks for SmolLM2's completions)."""
    gen, ids, outputs = embedded()
    choice = MethodChoice("hybrid-eagle", 6, (1, 1), 2.1, {"hybrid-eagle k=6 tree=1,1": (2.1, 3.1)})
    assert choice.options().tree == "1,1"
    monkeypatch.setattr(method_choice, "cached_method", lambda *a, **kw: choice)
    plan = resolve_method(gen.target, None, gen.tokenizer, "auto")
    assert plan.method == "hybrid-eagle" and plan.k == 6 and plan.options.heads is not None
    drafter = plan.drafter(None, gen.target)
    assert drafter.model.shape.depth(6) == 2
    auto = SpeculativeGenerator(gen.target, gen.tokenizer, drafter)
    for prompt, reference in zip(PROMPTS, outputs):
        assert auto.generate(prompt, max_new_tokens=32, num_speculative_tokens=plan.k).token_ids == reference
