"""Shared fixtures: tiny random checkpoints of every supported architecture, built locally."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(2)

TINY = dict(vocab_size=96, max_position_embeddings=128)


def hf_config(arch: str):
    """A tiny transformers config of one supported architecture."""
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, **TINY)
    if arch == "llama":
        return LlamaConfig(num_attention_heads=4, num_key_value_heads=4, **common)
    if arch == "llama-gqa-tied":
        return LlamaConfig(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **common)
    if arch == "llama3-rope":
        return LlamaConfig(
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=500000.0,
            rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                              high_freq_factor=4.0, original_max_position_embeddings=16),
            **common,
        )
    if arch == "mistral":
        return MistralConfig(num_attention_heads=4, num_key_value_heads=2, sliding_window=None, **common)
    if arch == "qwen2":
        return Qwen2Config(num_attention_heads=4, num_key_value_heads=2, **common)
    if arch == "gpt2":
        return GPT2Config(n_embd=32, n_layer=3, n_head=4, vocab_size=96, n_positions=128)
    raise ValueError(arch)


ARCHS = ["llama", "llama-gqa-tied", "llama3-rope", "mistral", "qwen2", "gpt2"]


def save_tiny(arch: str, path: Path, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(arch)).float().eval()
    # Random init leaves biases at zero; perturb them so bias loading is tested too.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="session", params=ARCHS)
def tiny_checkpoint(request, tmp_path_factory):
    """(arch, directory, transformers model) for each supported architecture."""
    path = tmp_path_factory.mktemp(request.param)
    model = save_tiny(request.param, path)
    return request.param, path, model
