"""CPU decode kernels: DecodeLinear equals nn.Linear for every row count, prepacked or not,
and a NativeLM using them gives the logits of the plain runtime."""

import pytest
import torch
from torch import nn

from quickdraft.models import decode_linear
from quickdraft.models.decode_linear import (
    DecodeLinear,
    mkl_prepack_available,
    prepack_decode_linears,
)
from quickdraft.models.lm import NativeLM
from quickdraft.models.loading import load_native

pytestmark = pytest.mark.skipif(not mkl_prepack_available(), reason="needs a PyTorch build with MKL")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("packed_rows", [0, 3, 9])
def test_decode_linear_equals_nn_linear(bias, packed_rows):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    fast = DecodeLinear(linear)
    fast.prepack(packed_rows)
    with torch.no_grad():
        for shape in [(1, 48), (3, 48), (9, 48), (1, 1, 48), (1, 9, 48), (3, 3, 48), (2, 5, 48), (1, 40, 48)]:
            x = torch.randn(shape)
            torch.testing.assert_close(fast(x), linear(x), atol=1e-5, rtol=1e-5)


def test_prepack_uses_the_packed_kernel_only_for_its_width():
    linear = nn.Linear(16, 24, bias=False)
    fast = DecodeLinear(linear)
    fast.prepack(5)
    assert fast.packed is not None and fast.packed_rows == 5
    fast.prepack(1)
    assert fast.packed is None and fast.packed_rows == 0


def test_native_lm_with_decode_linears_matches_plain_runtime(tiny_family):
    plain = NativeLM(load_native(tiny_family["target"]), decode_linears=False)
    fast = NativeLM(load_native(tiny_family["target"]))
    assert fast.decode_linears and not plain.decode_linears
    assert NativeLM(fast.model).decode_linears  # a second handle on the same model
    assert any(isinstance(m, DecodeLinear) for m in fast.model.modules())
    ids = torch.randint(0, 96, (20,))
    for lm in (plain, fast):
        lm.reset(64)
    fast.prepare(5)
    for chunk in (ids[:11], ids[11:16], ids[16:17], ids[17:20]):  # prefill, packed width, 1, other
        torch.testing.assert_close(fast.extend(chunk), plain.extend(chunk), atol=1e-4, rtol=1e-4)


def test_large_models_are_not_prepacked(tiny_family, monkeypatch):
    lm = NativeLM(load_native(tiny_family["target"]))
    monkeypatch.setattr(decode_linear, "MAX_PACKED_BYTES", 0)
    prepack_decode_linears(lm.model, 5)
    assert all(m.packed is None for m in lm.model.modules() if isinstance(m, DecodeLinear))
