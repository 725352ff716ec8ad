"""CPU decode kernels: DecodeLinear equals nn.Linear for every row count, rounds every row
alike whatever the row count, and a NativeLM using them gives the plain runtime's logits."""

import pytest
import torch
from torch import nn

from quickdraft.models.decode_linear import (
    DecodeLinear,
    canonical_rows,
    invariant_rows,
    onednn_linear_available,
    row_dependent_rounding,
    rows_are_invariant,
)
from quickdraft.models.lm import NativeLM
from quickdraft.models.loading import load_native

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="needs a PyTorch build with oneDNN")


@pytest.mark.parametrize("bias", [False, True])
def test_decode_linear_equals_nn_linear(bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    fast = DecodeLinear(linear)
    with torch.no_grad():
        for shape in [(1, 48), (3, 48), (9, 48), (1, 1, 48), (1, 9, 48), (3, 3, 48), (2, 5, 48), (1, 40, 48)]:
            x = torch.randn(shape)
            torch.testing.assert_close(fast(x), linear(x), atol=1e-5, rtol=1e-5)


def test_every_row_count_rounds_each_row_alike():
    """The batched engine skips canonical padding on this claim, so check it here, on the
    machine that runs the suite, at the embedded target's shapes too."""
    assert rows_are_invariant()
    assert rows_are_invariant(448, 1216, 20)
    assert canonical_rows(3, invariant=True) == 3 and canonical_rows(3) == 4


@pytest.mark.parametrize("in_features", [448, 1216, 1536])
def test_decode_linear_rounds_rows_alike_at_every_width(in_features):
    """oneDNN alone does not at some input widths (every width over 1024 on the AVX2 EPYC
    this was found on: the embedded target's MLP output, SmolLM2's): DecodeLinear mends
    those, so a verify pass rounds each token as a plain step does."""
    torch.manual_seed(0)
    linear = nn.Linear(in_features, 96)
    layer = DecodeLinear(linear)
    x = torch.randn(12, in_features)
    with torch.inference_mode():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(12)])
        assert all(torch.equal(layer(x[:rows]), alone[:rows]) for rows in range(1, 13))
        torch.testing.assert_close(layer(x), linear(x), atol=1e-5, rtol=1e-5)


def test_native_lm_with_decode_linears_matches_plain_runtime(tiny_family):
    plain = NativeLM(load_native(tiny_family["target"]), decode_linears=False)
    fast = NativeLM(load_native(tiny_family["target"]))
    assert fast.decode_linears and not plain.decode_linears
    assert NativeLM(fast.model).decode_linears  # a second handle on the same model
    assert any(isinstance(m, DecodeLinear) for m in fast.model.modules())
    assert invariant_rows(fast.model) and not invariant_rows(plain.model)
    ids = torch.randint(0, 96, (20,))
    for lm in (plain, fast):
        lm.reset(64)
    for chunk in (ids[:11], ids[11:16], ids[16:17], ids[17:20]):  # prefill, 5 tokens, 1, 3
        torch.testing.assert_close(fast.extend(chunk), plain.extend(chunk), atol=1e-4, rtol=1e-4)


def test_single_row_kernel_only_inside_row_dependent_rounding():
    """Small weights take MKL's one-row product only where the caller allows rounding that
    depends on the row count (a draft model's steps); everywhere else every row count
    rounds alike, which the target and batched rows rely on."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 256, bias=True)
    fast, big = DecodeLinear(linear), DecodeLinear(nn.Linear(1024, 1024))
    assert fast.single_row_weight is not None and big.single_row_weight is None
    x = torch.randn(4, 256)
    with torch.no_grad():
        rows = fast(x)
        outside = torch.cat([fast(x[i : i + 1]) for i in range(4)])
        with row_dependent_rounding():
            inside = torch.cat([fast(x[i : i + 1]) for i in range(4)])
            assert torch.equal(fast(x), rows)  # several rows: still oneDNN
        after = fast(x[:1])
    assert torch.equal(outside, rows) and torch.equal(after, rows[:1])
    torch.testing.assert_close(inside, linear(x), atol=1e-5, rtol=1e-5)
    assert not torch.equal(inside, rows)  # proves the other kernel ran


@pytest.mark.parametrize("shape", [(96, 448), (97, 1216)])
@pytest.mark.parametrize("dtype,kind", [(torch.bfloat16, "bf16"), (torch.float16, "f16"), (torch.float32, "f32")])
def test_sixteen_bit_valued_weights_stay_sixteen_bit_and_give_the_same_bits(dtype, kind, shape):
    """A float32 weight whose every value is a bfloat16 (float16) number, as a bf16 (fp16)
    checkpoint's is once loaded in float32, is kept in that format, half the bytes, and
    multiplied to float32's results bit for bit, every row count alike; a float32 weight of
    other values stays float32. (The prefill's row counts too: 40; a long row and an odd
    count of weight rows: the passes over pairs of weight rows, and their odd last row.)"""
    from quickdraft.models import cpu_kernels

    if cpu_kernels.library() is None:
        pytest.skip("needs our compiled kernels")
    torch.manual_seed(0)
    out_features, in_features = shape
    linear = nn.Linear(in_features, out_features, bias=True)
    with torch.no_grad():
        linear.weight.copy_(linear.weight.to(dtype).float())
    layer = DecodeLinear(linear)
    wide = DecodeLinear(linear)
    wide.exact_weight, wide.kind = wide.exact_weight.float(), "f32"
    assert layer.kind == kind and layer.exact_weight.dtype == dtype
    x = torch.randn(40, in_features)
    with torch.inference_mode():
        alone = torch.cat([wide(x[i : i + 1]) for i in range(40)])
        for rows in (1, 2, 3, 4, 5, 9, 10, 11, 13, 16, 17, 40):
            assert torch.equal(layer(x[:rows]), alone[:rows]), rows
