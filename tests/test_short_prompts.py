"""Prompts of one and two tokens, with every method on the embedded models: the shortest
prompts leave a drafter the least context (EAGLE's chain once read the features of a
one-token prompt before the prefill had given any, and the native chain crashed the
process with a segfault)."""

from __future__ import annotations

import pytest

from quickdraft.drafters.factory import BATCH_METHODS, METHODS
from quickdraft.generator import SpeculativeGenerator


@pytest.fixture(scope="module")
def plain():
    return SpeculativeGenerator.from_pretrained(method="ar")


@pytest.mark.parametrize("method", list(METHODS))
def test_one_and_two_token_prompts_decode_as_plain_decoding(method, plain):
    gen = SpeculativeGenerator.from_pretrained(method=method)
    last = gen.tokenizer("def")["input_ids"][-1]
    for prompt in ([last], [last, 88]):
        want = plain.generate(prompt, max_new_tokens=16).token_ids
        assert gen.generate(prompt, max_new_tokens=16).token_ids == want, (method, prompt)
        sampled = gen.generate(prompt, max_new_tokens=16, temperature=0.8, seed=0)
        assert len(sampled.token_ids) == sampled.stats.new_tokens > 0
        if method in BATCH_METHODS:
            rows = gen.generate([prompt, [last, 88, 5]], max_new_tokens=16)
            assert rows[0].token_ids == want, (method, prompt)
