"""The shipped SmolLM2-135M draft (``qd-smollm2-135m-draft``): ``--model smollm2-135m`` pairs
with it by default, and greedy speculative output equals plain greedy output, on chat
(through the template) and code. Skipped when smollm2-135m is not installed (CI)."""

from __future__ import annotations

import pytest
from smollm2 import FILE, MODEL, NEEDS_SMOLLM2

from quickdraft.models.registry import find_embedded

pytestmark = NEEDS_SMOLLM2


@pytest.mark.slow
def test_smollm2_pairs_with_its_shipped_draft_and_drafting_is_lossless():
    from quickdraft.generator import SpeculativeGenerator
    from quickdraft.models.registry import find_draft_dir

    draft = find_embedded(MODEL.draft)
    assert draft is not None and draft.target == "smollm2-135m"
    assert find_draft_dir(FILE) == draft.path
    spec = SpeculativeGenerator.from_pretrained("smollm2-135m", method="draft")
    plain = SpeculativeGenerator.from_pretrained("smollm2-135m", method="ar")
    prompts = [spec.chat_ids([{"role": "user", "content": "What is a good name for a cat?"}]),
               "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]
    for prompt in prompts:
        ours = spec.generate(prompt, max_new_tokens=40, temperature=0.0, num_speculative_tokens=4)
        assert ours.token_ids == plain.generate(prompt, max_new_tokens=40, temperature=0.0).token_ids
        assert ours.stats.drafted_tokens > 0  # the draft did propose
