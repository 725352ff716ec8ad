"""`--dtype bfloat16` on a CPU with AVX512_BF16: our bfloat16 products
(``kernels/bf16_products.c``) round each row alike whatever the row count, so every method
equals bfloat16 plain decoding token for token (no near-tie allowance, unlike PyTorch's
bfloat16 ops: tests/test_placement.py), and sampled output keeps the target's distribution."""

import json
from pathlib import Path

import pytest
import torch
from test_sampling_exact import VOCAB, NoResidual, empirical_pvalue, tiny_transformer

import quickdraft
from quickdraft.decoding.sampling import SamplingParams
from quickdraft.drafters import DraftModelDrafter
from quickdraft.generator import DraftOptions, SpeculativeGenerator
from quickdraft.models import cpu_kernels
from quickdraft.models.decode_linear import DecodeLinear
from quickdraft.models.lm import NativeLM

pytestmark = pytest.mark.skipif(not cpu_kernels.bf16_products_supported(), reason="this CPU lacks AVX512_BF16")


@pytest.mark.parametrize("K, N", [(64, 40), (96, 33), (448, 130), (1216, 70)])  # 96: an odd count of 32-chunks
def test_products_round_each_row_alike_and_near_the_exact_sum(K, N):
    torch.manual_seed(K)
    w, x = torch.randn(N, K).bfloat16(), torch.randn(30, K)
    full = cpu_kernels.bf16_products(x, w)
    for m in [1, 2, 5, 9, 12, 13, 25]:  # passes of up to 12 rows: both sides of the split
        assert torch.equal(cpu_kernels.bf16_products(x[:m], w), full[:m]), m
    exact = x.bfloat16().double() @ w.double().T  # the inputs rounded as the kernel does
    assert (full.double() - exact).abs().max() < 1e-5 * K ** 0.5 * exact.abs().max()
    # ... which is not the float32 product of the unrounded inputs:
    assert not torch.equal(full, cpu_kernels.half_matmul(x, w))


def test_only_bfloat16_values_take_the_products():
    """A weight that is not all bfloat16 values keeps its float32 kernel (no silent rounding)."""
    linear = torch.nn.Linear(64, 8, bias=False)
    assert DecodeLinear(linear, bf16_products=True).kind == "f32"
    linear.weight.data = linear.weight.data.bfloat16().float()
    assert DecodeLinear(linear, bf16_products=True).kind == "bf16dp"
    assert DecodeLinear(linear).kind == "bf16"


BENCH = Path(quickdraft.__file__).parent / "assets" / "bench"


def bench_prompts(n: int) -> list[str]:
    return [json.loads(line)["prompt"] for category in ("short", "long", "out-of-domain")
            for line in (BENCH / f"{category}.jsonl").read_text().splitlines()[:n]]


@pytest.fixture(scope="module")
def plain_bf16():
    ar = SpeculativeGenerator.from_pretrained(method="ar", dtype="bfloat16")
    assert ar.target.model.bf16_products
    return {p: ar.generate(p, max_new_tokens=64).token_ids for p in bench_prompts(2)}


@pytest.mark.parametrize("method, options", [
    ("draft", DraftOptions()), ("eagle", DraftOptions(tree="1,1,1,1,1,1,1,1")), ("eagle", DraftOptions()),
    ("early-exit", DraftOptions()), ("medusa", DraftOptions()),
], ids=["draft", "eagle-chain8", "eagle-tree", "early-exit", "medusa"])
def test_embedded_methods_in_bf16_equal_plain_exactly(plain_bf16, method, options):
    gen = SpeculativeGenerator.from_pretrained(method=method, dtype="bfloat16", options=options)
    assert {m.kind for m in gen.target.model.modules() if isinstance(m, DecodeLinear)} == {"bf16dp"}
    for prompt, want in plain_bf16.items():
        assert gen.generate(prompt, max_new_tokens=64, num_speculative_tokens=8).token_ids == want, prompt[:40]


def bf16_products_lm(seed: int) -> NativeLM:
    """tests/test_sampling_exact.py's tiny model, 32 wide (our products need K % 32 == 0),
    as loading.build_native prepares a bfloat16 model on this CPU."""
    model = tiny_transformer(seed, 3.0, width=32).to(torch.bfloat16).float()
    model.bf16_products = True
    lm = NativeLM(model.eval())
    assert {m.kind for m in model.modules() if isinstance(m, DecodeLinear)} == {"bf16dp"}
    return lm


@pytest.mark.slow
def test_sampling_on_bf16_products_matches_the_target_and_a_wrong_rule_fails():
    target, drafter = bf16_products_lm(0), DraftModelDrafter(bf16_products_lm(1), VOCAB)
    params = SamplingParams(temperature=1.0)
    assert empirical_pvalue(target, drafter, params, n_samples=2000) > 1e-3
    assert empirical_pvalue(target, drafter, params, NoResidual, n_samples=2000) < 1e-6


def test_a_float32_target_keeps_its_fingerprint_and_storage_sharing_in_bf16(tiny_family):
    """Heads are found for a target by a fingerprint of bfloat16-rounded weights, so a
    float32 checkpoint's heads still load when it runs ``--dtype bfloat16``; rounding
    leaves alone a tensor that is rounded already (a draft's shared embedding keeps its
    storage, tests/test_shared_embed.py)."""
    from quickdraft.models.exit_head import target_fingerprint
    from quickdraft.models.lm import load_model
    from quickdraft.models.placement import resolve_placement

    fp32 = load_model(tiny_family["target"]).model
    bf16 = load_model(tiny_family["target"], placement=resolve_placement("cpu", "bfloat16")).model
    assert not torch.equal(fp32.embed.weight.bfloat16().float(), fp32.embed.weight)  # float32 values
    assert target_fingerprint(fp32) == target_fingerprint(bf16)
