"""The EAGLE drafter shipped for SmolLM2-135M-Instruct (trained on a GPU: docs/gpu.md) is
found for it by default, and its token trees keep greedy output equal to plain decoding.
Skipped when the model is not installed (CI does not download it; ``make real-model``)."""

from __future__ import annotations

from smollm2 import NEEDS_SMOLLM2

from quickdraft.drafters.factory import DraftOptions
from quickdraft.generator import SpeculativeGenerator

pytestmark = NEEDS_SMOLLM2

PROMPT = "def is_prime(n):\n"


def test_shipped_eagle_is_the_default_for_smollm2_and_lossless():
    from quickdraft.drafters.eagle import shipped_eagle

    plain = SpeculativeGenerator.from_pretrained("smollm2-135m", method="ar")
    assert shipped_eagle(plain.target).name == "smollm2-135m-eagle"
    expected = plain.generate(PROMPT, max_new_tokens=32).token_ids
    assert len(expected) == 32
    for tree in ("1,1,1,1,1", "dynamic:8"):
        gen = SpeculativeGenerator.from_pretrained("smollm2-135m", method="eagle", options=DraftOptions(tree=tree))
        out = gen.generate(PROMPT, max_new_tokens=32)
        assert out.token_ids == expected
        assert out.stats.mean_accepted_tokens > 1  # the head drafts, and some drafts are kept
