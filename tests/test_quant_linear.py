"""Quantized linears: GGUF Q4 blocks taken exactly, row invariance, loading and its errors."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from gguf_files import write_tiny_gguf

from quickdraft.models import gguf
from quickdraft.models.lm import NativeLM, load_model
from quickdraft.models.loading import load_native
from quickdraft.models.placement import PlacementError, resolve_placement
from quickdraft.models.quant_linear import (
    Int4Linear,
    Int8Linear,
    fast_kernels,
    kernel_rows_are_invariant,
    kernels_available,
    native_kernels,
)

pytestmark = pytest.mark.skipif(not kernels_available(), reason="this torch lacks the CPU int4/int8 kernels")
PROMPT = torch.tensor([5, 17, 200, 3, 99, 42, 7, 260, 1, 64])


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_q4_blocks_map_exactly_onto_int4_groups(tmp_path, qtype):
    path = tmp_path / f"tiny-{qtype}.gguf"
    stored = write_tiny_gguf(path, qtype)  # what gguf's own dequantizer makes of the file
    config = gguf.native_config(path)
    blocks = gguf.convert_int4_blocks(path, config)
    assert set(blocks) == {f"layers.{i}.{m}" for i in range(config.n_layers) for m in gguf.FUSED_LINEARS}
    p = "model.layers.1."
    for module, parts in [("attn.wqkv", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
                          ("mlp.w_in", ["mlp.gate_proj", "mlp.up_proj"]), ("mlp.w_out", ["mlp.down_proj"])]:
        expected = torch.cat([stored[f"{p}{part}.weight"] for part in parts])
        q, scale, zero = blocks[f"layers.1.{module}"]
        assert q.dtype == torch.uint8 and int(q.max()) <= 15
        groups = (q.float() - 8).reshape(*scale.shape, 32) * scale[..., None] + zero[..., None]
        # d q + m and (q - 8) d + (m + 8 d) round alike up to one float32 ulp.
        torch.testing.assert_close(groups.reshape(expected.shape), expected, rtol=2e-7, atol=1e-7)
        # ... and the kernel multiplies by those weights (through the identity matrix).
        torch.testing.assert_close(Int4Linear(q, scale, zero).dequantized(), expected, rtol=2e-6, atol=1e-6)


def test_the_real_smollm2_q4_1_tensor_maps_exactly():
    from gguf.quants import dequantize

    from quickdraft.models.registry import find_packaged, packaged_file

    packaged = find_packaged("smollm2-135m")
    file = packaged_file(packaged) if packaged else None
    if file is None:
        pytest.skip("smollm2-135m is not installed")
    tensor = next(t for t in gguf.open_gguf(file).tensors if t.name == "blk.0.ffn_up.weight")
    assert gguf.type_name(tensor) == "Q4_1"
    q, scale, zero = gguf.q4_groups(tensor)
    expected = torch.from_numpy(np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float32))
    groups = (q.float() - 8).reshape(*scale.shape, 32) * scale[..., None] + zero[..., None]
    torch.testing.assert_close(groups.reshape(expected.shape), expected, rtol=2e-7, atol=1e-7)


def random_layer(kind: str, out_features: int, in_features: int, seed: int, scale: float = 1.0):
    """A layer of ``kind`` (int4 / int8) quantized from a seeded random weight, and that weight."""
    torch.manual_seed(seed)
    weight = torch.randn(out_features, in_features) * scale
    return (Int4Linear.from_weight(weight) if kind == "int4" else Int8Linear(weight)), weight


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_each_row_is_computed_alike_whatever_the_row_count(kind):
    layer, _ = random_layer(kind, 96, 64, seed=0)
    x = torch.randn(12, 64)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(12)])
    for rows in range(1, 13):
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows
    assert torch.equal(layer(x[None, :5])[0], alone[:5])  # [batch, tokens, features] too
    # The kernel alone (no row-by-row fallback) is invariant on this machine: measured here.
    print(kind, "kernel row-invariant:", kernel_rows_are_invariant(kind))


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` as our int8 and int4 products see it, in float64: quantized per row and group
    of 32 as llama.cpp quantizes activations (``d = max|x| / 127`` and ``x * (1 / d)``
    rounded half to even, in float32), times ``d``."""
    groups = x.float().reshape(x.shape[0], -1, 32)
    d = groups.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    xq = (groups * inv[..., None]).round()
    assert xq.abs().max() <= 127
    return (xq.double() * d.double()[..., None]).reshape(x.shape)


def q8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What ``cpu_kernels.q8_matmul`` computes, in float64: the quantized activations times
    the dequantized int8 weight."""
    weight = (q.double().view(q.shape[0], -1, 32) * scale.double()[..., None]).view(q.shape)
    return quantized_activations(x) @ weight.t()


def q4_weight(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``(q - 8) * scale + zero`` group by group, in float64."""
    groups = (q.double().view(q.shape[0], -1, 32) - 8) * scale.double()[..., None] + zero.double()[..., None]
    return groups.view(q.shape)


def test_int8_products_quantize_activations_as_llama_cpp_does():
    """Our int8 product (tiles of 16 weight rows, kernels/q8a8.h) multiplies 8-bit
    activations (per group of 32) by the int8 weights: exact integer sums per group, so it
    matches the float64 reference to float32 rounding on both instruction sets, bit for bit
    alike (|q| = 128 included), widths not a multiple of 16; multiplying float32
    activations instead (the old rule) is far outside that. The tiles hold q and the scales
    as given."""
    from quickdraft.models import cpu_kernels

    if not native_kernels():
        pytest.skip("needs our compiled kernels")
    torch.manual_seed(5)
    try:
        for n, k in [(96, 64), (75, 1216), (7, 96), (17, 32)]:
            q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
            scale = torch.rand(n, k // 32) * 0.01
            packed = cpu_kernels.pack_q8(q, scale)
            assert all(torch.equal(a, b) for a, b in zip(cpu_kernels.unpack_q8(packed, n), (q, scale)))
            x = torch.randn(9, k) * torch.rand(9, k // 32).repeat_interleave(32, 1) * 4  # groups of unequal range
            x[0, :32] = 0  # an all-zero group: d = 0
            expected = q8_reference(x, q, scale)
            results = []
            for isa in ("avx2", cpu_kernels.kernel_isa(None)):
                cpu_kernels.kernel_isa(isa)
                results.append(cpu_kernels.q8_matmul(x, packed, n))
                torch.testing.assert_close(results[-1].double(), expected, rtol=1e-5,
                                           atol=1e-5 * expected.abs().max().item())
            assert torch.equal(results[0], results[-1])
            float_rule = x.double() @ (q.double().view(n, -1, 32) * scale.double()[..., None]).view(n, k).t()
            assert (float_rule - expected).abs().max() > 100 * 1e-5 * expected.abs().max()
    finally:
        cpu_kernels.kernel_isa("avx512")


def test_int4_products_quantize_activations_as_llama_cpp_does():
    """Our int4 product (tiles of 16 weight rows, kernels/q4a8.h) multiplies 8-bit
    activations by the 4-bit weights, exact integer sums per group: the float64 reference
    to float32 rounding on both instruction sets, bit for bit alike, widths not a multiple
    of 16 (padded tiles); multiplying float32 activations instead is far outside that. The
    blocks hold the weight exactly as given where its scale and minimum are float16 values
    (GGUF's Q4_1: d and m), and round them to float16 where they are not."""
    from quickdraft.models import cpu_kernels

    if not native_kernels():
        pytest.skip("needs our compiled kernels")
    torch.manual_seed(7)
    try:
        for n, k in [(96, 64), (75, 1216), (7, 96), (17, 32)]:
            q = torch.randint(0, 16, (n, k))
            scale, low = (torch.rand(n, k // 32) * 0.01).half().float(), (torch.randn(n, k // 32) * 0.01).half().float()
            zero = low + 8 * scale
            packed = cpu_kernels.pack_q4(q, scale, zero)
            assert all(torch.equal(a, b) for a, b in zip(cpu_kernels.q4_scales(packed, n), (scale, low), strict=True))
            weight = q4_weight(q, scale, zero)
            torch.testing.assert_close(cpu_kernels.unpack_q4(packed, n).double(), weight, rtol=1e-6, atol=1e-7)
            wide = torch.rand(n, k // 32) * 0.01  # not float16 values: rounded on the way in
            assert torch.equal(cpu_kernels.q4_scales(cpu_kernels.pack_q4(q, wide, zero), n)[0], wide.half().float())
            x = torch.randn(9, k) * torch.rand(9, k // 32).repeat_interleave(32, 1) * 4
            x[0, :32] = 0  # an all-zero group: d = 0
            expected = quantized_activations(x) @ weight.t()
            results = []
            for isa in ("avx2", cpu_kernels.kernel_isa(None)):
                cpu_kernels.kernel_isa(isa)
                results.append(cpu_kernels.q4_matmul(x, packed, n))
                torch.testing.assert_close(results[-1].double(), expected, rtol=1e-5,
                                           atol=1e-5 * expected.abs().max().item())
            assert torch.equal(results[0], results[-1])
            float_rule = x.double() @ weight.t()
            assert (float_rule - expected).abs().max() > 100 * 1e-5 * expected.abs().max()
    finally:
        cpu_kernels.kernel_isa("avx512")


def test_int4_quantizes_to_the_nearest_level_of_its_float16_scale():
    """Int4Linear.from_weight rounds each group's scale and minimum to float16 before
    choosing the nibbles (as llama.cpp's Q4_1 does; the blocks keep them in float16): every
    weight ends within half a step of the stored scale, which choosing by the float32 scale
    and storing it rounded would not keep."""
    from quickdraft.models import cpu_kernels

    layer, weight = random_layer("int4", 96, 256, seed=0, scale=0.05)
    if not layer.native:
        pytest.skip("needs our compiled kernels")
    scale, offset = cpu_kernels.q4_scales(layer.tiles, 96)
    assert torch.equal(scale, scale.half().float()) and torch.equal(offset, offset.half().float())
    error = (layer.dequantized() - weight).abs().view(96, -1, 32)
    assert (error <= scale[..., None] / 2 * (1 + 1e-4)).all()
    with pytest.raises(ValueError, match="float16"):
        Int4Linear.from_weight(torch.full((16, 32), 1e5))


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quantized_products_stay_close_to_float32(kind):
    layer, weight = random_layer(kind, 96, 64, seed=0, scale=0.05)
    x = torch.randn(4, 64)
    if layer.native:  # 8-bit activations: see the tests above
        expected = (quantized_activations(x) @ layer.dequantized().double().t()).float()
    else:
        expected = x @ layer.dequantized().t()
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    error = (layer.dequantized() - weight).abs().max().item()
    # Half a quantization step: a group's range / 30 (int4), a channel's max / 254 (int8).
    assert error <= (0.05 * 8 / 30 if kind == "int4" else 0.05 * 5 / 254)


def test_gguf_q4_loads_in_int4_and_safetensors_quantize(tmp_path):
    path = tmp_path / "tiny-Q4_1.gguf"
    write_tiny_gguf(path, "Q4_1")
    int4 = load_native(path, quantize="int4")
    assert isinstance(int4.layers[0].attn.wqkv, Int4Linear)
    # The head: int8 where our kernels run (PyTorch's would be slower than float32).
    assert isinstance(int4.lm_head, Int8Linear) if native_kernels() else type(int4.lm_head) is torch.nn.Linear
    assert not any(isinstance(m, Int4Linear) for m in load_native(path, quantize="none").modules())
    assert (gguf.cache_entry(path) / gguf.INT4_FILE).is_file()
    again = load_native(path, quantize="int4")  # from the cache: the same weights
    torch.testing.assert_close(again.layers[1].mlp.w_in.dequantized(), int4.layers[1].mlp.w_in.dequantized(),
                               rtol=0, atol=0)
    int8 = load_native(path, quantize="int8")
    assert isinstance(int8.layers[1].mlp.w_out, Int8Linear)
    lm = load_model(path, placement=resolve_placement(quantize="int4"))
    assert isinstance(lm, NativeLM) and isinstance(lm.model.layers[0].mlp.w_in, Int4Linear)


def test_unusable_combinations_are_one_line_errors():
    for kwargs, words in [({"quantize": "int3"}, "unknown --quantize"),
                          ({"quantize": "int4", "dtype": "bfloat16"}, "float32"),
                          ({"quantize": "int8", "device": "cuda"}, "cuda")]:
        with pytest.raises(PlacementError) as info:
            resolve_placement(**kwargs)
        assert words in str(info.value) and "\n" not in str(info.value)
    assert resolve_placement(quantize="INT4").quantize == "int4"
    assert resolve_placement().quantize == "auto"


def test_our_kernels_build_and_run_on_x86_avx2():
    """Where a C compiler and AVX2 exist (this machine and CI), the layers use our kernels:
    PyTorch's int8/int4 kernels are scalar on AVX2."""
    import os
    import shutil

    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512") or not shutil.which("cc"):
        pytest.skip("our kernels need x86 AVX2 and a C compiler")
    if os.environ.get("QUICKDRAFT_NATIVE_KERNELS") == "0":
        pytest.skip("QUICKDRAFT_NATIVE_KERNELS=0 turns them off")
    assert native_kernels()
    weight = torch.randn(48, 64)
    assert Int8Linear(weight).native and Int4Linear.from_weight(weight).native


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_results_do_not_depend_on_the_thread_count(kind):
    if kind == "int4" and not native_kernels():
        pytest.skip("PyTorch's int4 kernel takes rows in multiples of 16 (quantize_linears keeps others float)")
    layer, _ = random_layer(kind, 200, 96, seed=1)
    x = torch.randn(9, 96)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x)
        torch.set_num_threads(2)
        assert torch.equal(layer(x), one)
    finally:
        torch.set_num_threads(threads)


def test_a_q8_0_file_loads_as_its_own_int8_groups(tmp_path):
    """``--quantize auto`` on a Q8_0 GGUF file runs its linears and its head (SmolLM2's
    Q4_1 file stores its tied embedding in Q8_0) on the file's int8 values and scales."""
    if not native_kernels():
        pytest.skip("int8 groups of 32 need our kernels")
    path = tmp_path / "tiny-Q8_0.gguf"
    stored = write_tiny_gguf(path, "Q8_0", tied=True)
    q, scale = gguf.q8_head(path)
    assert q.dtype == torch.int8 and scale.shape == (q.shape[0], q.shape[1] // 32)
    expected = stored["model.embed_tokens.weight"]
    torch.testing.assert_close((q.float().view(*scale.shape, 32) * scale[..., None]).view_as(expected), expected,
                               rtol=0, atol=0)
    model = load_native(path, quantize="auto")
    assert isinstance(model.lm_head, Int8Linear)
    torch.testing.assert_close(model.lm_head.dequantized(), expected, rtol=0, atol=0)
    # Kept in the cache entry: a second load never parses the file (seconds for a real vocabulary).
    assert (gguf.cache_entry(path) / gguf.INT8_FILE).is_file()
    gguf._open_gguf.cache_clear()
    with mock.patch("gguf.GGUFReader", side_effect=AssertionError("parsed the file again")):
        again = load_native(path, quantize="auto")
    assert torch.equal(again.lm_head.dequantized(), model.lm_head.dequantized())
    p = "model.layers.1."
    for module, parts in [("attn.wqkv", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
                          ("mlp.w_in", ["mlp.gate_proj", "mlp.up_proj"]), ("mlp.w_out", ["mlp.down_proj"])]:
        layer = model.get_submodule(f"layers.1.{module}")
        assert isinstance(layer, Int8Linear) and layer.native
        fused = torch.cat([stored[f"{p}{part}.weight"] for part in parts])
        torch.testing.assert_close(layer.dequantized(), fused, rtol=0, atol=0)
    # The embedding keeps its float table; none leaves every weight float.
    assert torch.equal(model.embed.weight, expected)
    assert type(load_native(path, quantize="none").lm_head) is torch.nn.Linear
    # A restricted head (a draft's vocabulary) takes the rows the quantized head multiplies by.
    model.restrict_head([3, 1, 4])
    torch.testing.assert_close(model.sub_head.weight, expected[[3, 1, 4]], rtol=0, atol=0)


def test_a_q4_file_with_auto_runs_int4_blocks_and_matches_plain_logits(tmp_path):
    """``auto`` runs a Q4_0 file's linears on its own 4-bit values (the tiles hold the
    file's weights to float32 rounding); with 8-bit activations (as llama.cpp runs the
    file) its logits stay within ~2% of the dequantized float32 model's."""
    if not native_kernels():
        pytest.skip("auto quantizes only where the kernels are fast")
    path = tmp_path / "tiny-Q4_0.gguf"
    stored = write_tiny_gguf(path, "Q4_0")
    auto, plain = load_native(path, quantize="auto"), load_native(path, quantize="none")
    assert isinstance(auto.layers[0].mlp.w_in, Int4Linear) and type(auto.lm_head) is torch.nn.Linear  # only a Q8_0 head is taken
    fused = torch.cat([stored[f"model.layers.1.mlp.{part}.weight"] for part in ("gate_proj", "up_proj")])
    torch.testing.assert_close(auto.layers[1].mlp.w_in.dequantized(), fused, rtol=2e-6, atol=1e-6)
    with torch.inference_mode():
        a, b = (m(PROMPT[None], 0, m.new_cache(1, 32)).logits for m in (auto, plain))
    assert (a - b).abs().max() < 0.05 * b.abs().max()


def test_without_our_kernels_auto_keeps_float32(tmp_path, monkeypatch):
    """PyTorch's int4/int8 kernels are slower than float32 even on AVX-512 (quant_linear's
    docstring), so where ours do not run, ``auto`` dequantizes a Q4 file."""
    from quickdraft.models import cpu_kernels

    path = tmp_path / "tiny-Q4_1.gguf"
    write_tiny_gguf(path, "Q4_1")
    monkeypatch.setenv("QUICKDRAFT_NATIVE_KERNELS", "0")
    cpu_kernels.library.cache_clear()
    try:
        assert not fast_kernels()
        model = load_native(path, quantize="auto")
        assert not any(isinstance(m, (Int4Linear, Int8Linear)) for m in model.modules())
    finally:
        monkeypatch.delenv("QUICKDRAFT_NATIVE_KERNELS")
        cpu_kernels.library.cache_clear()


def test_quantized_layers_refuse_to_train():
    layer = Int8Linear(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="quantize='none'"):
        layer(torch.randn(2, 64, requires_grad=True))


def test_avx512_and_avx2_products_agree_bit_for_bit():
    """qmatmul_avx512.c rounds every element as qmatmul.c does: row counts across both
    files' passes (int8 and int4 tiles: AVX2 halves of 4 rows, VNNI pairs of tiles 4 rows
    at a time up to 4 rows and from 25, single tiles 8 at a time between, widths not a
    multiple of 16; float32 (one 16-lane
    accumulator is the AVX2 kernel's two 8-lane ones): a prefetching row pass of 4-16 rows,
    4 x 4 tiles from 17; bfloat16 and float16 weights: the pass to 16 rows, the tiles from
    17, and float32's result for the widened weights), widths not a multiple of 4. Also each AVX2 product's several-row passes against its single rows (float32
    row pass up to 7 rows, tiles from 8)."""
    from quickdraft.models import cpu_kernels

    if not native_kernels():
        pytest.skip("needs our compiled kernels")
    if cpu_kernels.kernel_isa("avx512") != "avx512":
        pytest.skip("this CPU has no AVX-512")
    torch.manual_seed(3)
    try:
        for n, k in [(96, 64), (75, 96), (50, 1216)]:
            scale, zero, weight = torch.rand(n, k // 32), torch.randn(n, k // 32), torch.randn(n, k)
            q4 = (cpu_kernels.pack_q4(torch.randint(0, 16, (n, k)), scale, zero), n)
            q8 = (cpu_kernels.pack_q8(torch.randint(-127, 128, (n, k), dtype=torch.int8), scale), n)
            products = {"q4": (cpu_kernels.q4_matmul, q4), "q8": (cpu_kernels.q8_matmul, q8),
                        "f32": (cpu_kernels.f32_matmul, (weight,)), "bf16": (cpu_kernels.half_matmul, (weight.bfloat16(),)),
                        "f16": (cpu_kernels.half_matmul, (weight.half(),))}
            x = torch.randn(27, k)
            for name, (product, weights) in products.items():
                cpu_kernels.kernel_isa("avx2")
                alone = torch.cat([product(x[i : i + 1], *weights) for i in range(len(x))])
                if name in ("bf16", "f16"):  # 16-bit weights widen exactly: float32's products of the same values
                    assert torch.equal(alone, torch.cat([cpu_kernels.f32_matmul(x[i : i + 1], weights[0].float())
                                                         for i in range(len(x))]))
                for isa in ("avx2", "avx512"):  # each path's several-row passes, against AVX2's single rows
                    cpu_kernels.kernel_isa(isa)
                    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 16, 17, 20, 24, 25, 27):
                        assert torch.equal(product(x[:rows], *weights), alone[:rows]), (isa, name, n, k, rows)
    finally:
        cpu_kernels.kernel_isa("avx512")


def test_kernels_build_where_the_cache_directory_is_unusable(tmp_path, monkeypatch):
    """An XDG_CACHE_HOME that is a file: the library is built in a temporary directory for
    this process, not given up (which would turn our kernels off for the whole process)."""
    from quickdraft.models import cpu_kernels

    if cpu_kernels.library() is None:
        pytest.skip("needs our compiled kernels")
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    built = cpu_kernels._build(cpu_kernels._compiler())
    assert built.is_file() and blocker not in built.parents
    assert cpu_kernels.fingerprint().endswith(cpu_kernels.kernel_isa())
