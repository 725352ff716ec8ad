"""Native runtime vs transformers: same logits for prefill and cached steps (fp32)."""

import torch

from quickdraft.models.hf_cache import forward_with_cache
from quickdraft.models.loading import load_native


def test_logits_match_transformers(tiny_checkpoint):
    arch, path, hf = tiny_checkpoint
    native = load_native(path)
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (1, 12))
    cache = native.new_cache(1, 64)
    with torch.no_grad():
        ref_logits, past = forward_with_cache(hf, ids[:, :8])
        got = native(ids[:, :8], torch.arange(8)[None], cache)
        torch.testing.assert_close(got.logits, ref_logits, atol=1e-4, rtol=1e-4)
        for t in range(8, 12):  # several cached single-token steps
            ref_logits, past = forward_with_cache(hf, ids[:, t : t + 1], past)
            got = native(ids[:, t : t + 1], torch.tensor([[t]]), cache)
            torch.testing.assert_close(got.logits, ref_logits, atol=1e-4, rtol=1e-4, msg=f"{arch} step {t}")
