"""Native runtime vs transformers: same logits for prefill and cached steps (fp32)."""

import torch

from quickdraft.models.loading import load_native


def test_logits_match_transformers(tiny_checkpoint):
    arch, path, hf = tiny_checkpoint
    native = load_native(path)
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (1, 12))
    cache = native.new_cache(1, 64)
    with torch.no_grad():
        ref = hf(ids[:, :8], use_cache=True)
        got = native(ids[:, :8], torch.arange(8)[None], cache)
        torch.testing.assert_close(got.logits, ref.logits, atol=1e-4, rtol=1e-4)
        past = ref.past_key_values
        for t in range(8, 12):  # several cached single-token steps
            ref = hf(ids[:, t : t + 1], past_key_values=past, use_cache=True)
            past = ref.past_key_values
            got = native(ids[:, t : t + 1], torch.tensor([[t]]), cache)
            torch.testing.assert_close(got.logits, ref.logits, atol=1e-4, rtol=1e-4, msg=f"{arch} step {t}")
