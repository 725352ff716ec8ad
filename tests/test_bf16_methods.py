"""Every method of the embedded pair in bfloat16 on the CPU: its drafter's state (EAGLE
features, exit heads, Medusa and prophet heads, layer-skip passes) follows the models'
dtype, and greedy output is bf16 plain decoding's (up to a near-tie, see
tests/test_placement.py)."""

import pytest
from test_placement import assert_lossless_bf16

from quickdraft.drafters import METHODS
from quickdraft.generator import SpeculativeGenerator

PROMPTS = ["def median(values):\n", "class Stack:\n    def __init__(self"]


@pytest.fixture(scope="module")
def plain():
    ar = SpeculativeGenerator.from_pretrained(method="ar", dtype="bfloat16")
    return ar, [ar.generate(p, max_new_tokens=32).token_ids for p in PROMPTS]


@pytest.mark.slow
@pytest.mark.parametrize("method", [m for m in METHODS if m not in ("ar", "auto")])
def test_every_method_in_bf16_equals_bf16_plain(plain, method):
    ar, wants = plain
    gen = SpeculativeGenerator.from_pretrained(method=method, dtype="bfloat16")
    for prompt, want in zip(PROMPTS, wants):
        got = gen.generate(prompt, max_new_tokens=32).token_ids
        assert_lossless_bf16(ar.target, ar.encode(prompt), got, want, (method, prompt))
