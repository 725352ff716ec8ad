"""The head methods (Medusa, prophet, EAGLE) serve batched rows: a chain drafter per row
reading its own row's hidden states, the target's verify pass batched; every row's greedy
output is plain decoding's, and the heads really draft (tokens are accepted)."""

from __future__ import annotations

import pytest

from quickdraft.batch_generate import make_batch_engine
from quickdraft.drafters.per_row import PerRowDrafter
from quickdraft.generator import SpeculativeGenerator

PROMPTS = ["def add(a, b):\n    return", "import os\n\ndef main():\n    path = os.path.",
           "class Point:\n    def __init__(self, x, y):\n        self."]


@pytest.fixture(scope="module")
def plain():
    gen = SpeculativeGenerator.from_pretrained(method="ar")
    return [gen.generate(p, max_new_tokens=40).token_ids for p in PROMPTS]


@pytest.mark.parametrize("method", ["medusa", "prophet", "eagle", "hybrid-eagle"])
def test_batched_head_rows_are_lossless_and_draft(method, plain):
    gen = SpeculativeGenerator.from_pretrained(method=method)
    outs = gen.generate(PROMPTS, max_new_tokens=40, batch_size=len(PROMPTS))
    assert [o.token_ids for o in outs] == plain
    assert sum(o.stats.accepted_tokens for o in outs) > 0  # the heads drafted and were right
    # Rows join and leave at different times (2 slots, 3 prompts): each still decodes alone.
    outs = gen.generate(PROMPTS, max_new_tokens=40, batch_size=2, num_speculative_tokens=3)
    assert [o.token_ids for o in outs] == plain


def test_the_batched_engine_of_a_head_method_drafts_a_chain_per_row():
    gen = SpeculativeGenerator.from_pretrained(method="eagle")
    engine = make_batch_engine(gen.target, "eagle", None, max_batch_size=2, options=gen.plan.options)
    assert isinstance(engine.drafter, PerRowDrafter) and engine.num_speculative_tokens == 6
    assert engine.drafter.rows[0].head is engine.drafter.rows[1].head  # heads loaded once, shared


def test_batched_rows_of_a_fused_eagle_drafter_read_every_layer_it_fuses(plain, tmp_path):
    """An EAGLE-3-style drafter (three of the target's layers, fused) in batched rows: each
    row's verify pass hands over all three states, and every row's output is plain decoding's."""
    from test_eagle import fused_copy

    from quickdraft.drafters import DraftOptions

    gen = SpeculativeGenerator.from_pretrained(method="ar")
    path = fused_copy(gen.target.model, (2, 5, 8), tmp_path / "fused")
    gen = SpeculativeGenerator.from_pretrained(method="eagle", options=DraftOptions(heads=path))
    outs = gen.generate(PROMPTS, max_new_tokens=40, batch_size=2, num_speculative_tokens=4)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.stats.accepted_tokens for o in outs) > 0
    engine = make_batch_engine(gen.target, "eagle", None, max_batch_size=2, options=gen.plan.options)
    assert engine.reads == (2, 5, 8)


def test_batched_head_rows_draft_the_generators_k(plain):
    """A list of prompts through a head method drafts the generator's settled k (the cost
    model's, as one prompt would), not the method's fixed HEAD_BATCH_K."""
    from quickdraft.drafters.per_row import HEAD_BATCH_K

    gen = SpeculativeGenerator.from_pretrained(method="eagle")
    gen.num_speculative_tokens = 2  # as if the cost model had settled it
    outs = gen.generate(PROMPTS, max_new_tokens=40, batch_size=len(PROMPTS))
    assert [o.token_ids for o in outs] == plain
    deepest = max(len(o.stats.drafted_per_position) for o in outs)
    assert deepest == 2 < HEAD_BATCH_K["eagle"]


def test_batched_hybrid_eagle_rows_look_up_else_draft_their_own_chain(plain, monkeypatch):
    """hybrid-eagle's batched rows: each row's prompt lookup where its tail matches (up to
    k = 6 tokens alone, 2 beside other rows), else that row's EAGLE chain (at most 2), the
    drafter catching up on the lookup's tokens when it next drafts; every row's output is
    plain decoding's."""
    from quickdraft.drafters.hybrid import HybridDrafter
    from quickdraft.drafters.ngram import NgramDrafter

    gen = SpeculativeGenerator.from_pretrained(method="hybrid-eagle")
    engine = make_batch_engine(gen.target, "hybrid-eagle", None, max_batch_size=2, options=gen.plan.options)
    assert isinstance(engine.drafter, HybridDrafter) and isinstance(engine.drafter.model, PerRowDrafter)
    assert (engine.k_for(1), engine.k_for(2), engine.k_for(8)) == (6, 2, 2)  # lone: k; else the chain
    sizes: dict[str, list[int]] = {"ngram": [], "eagle": []}
    for who, cls in (("ngram", NgramDrafter), ("eagle", PerRowDrafter)):
        def record(self, slots, sequences, ks, propose=cls.propose, who=who):
            found = propose(self, slots, sequences, ks)
            sizes[who] += [p.size for p in found if p.size]
            return found
        monkeypatch.setattr(cls, "propose", record)
    outs = gen.generate(PROMPTS, max_new_tokens=40, batch_size=2)
    assert [o.token_ids for o in outs] == plain
    assert sizes["ngram"] and sizes["eagle"], sizes  # both drafted
    assert max(sizes["eagle"]) <= 2 < max(sizes["ngram"]) <= 6, sizes
