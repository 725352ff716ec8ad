"""``--kv-cache float16``: keys and values stored in 16 bits, attention in float32.

What it must keep: attention over a float16 cache is float32 attention over the rounded
keys and values, bit for bit, whichever path reads them (a one-token step widens them as it
reads, a pass of several has each thread widen a head once), so a verify pass still rounds
each token as the plain step does and speculative output equals plain decoding with the
same cache; the torch path (training, other devices) reads the same values; a placement
that cannot use it is a one-line error."""

from __future__ import annotations

import pytest
import torch
from gguf_files import write_tiny_gguf
from test_layer_ops import attend, pass_and_steps, rope_tables, tiny_model

from quickdraft.cli import main
from quickdraft.decoding.engine import decode
from quickdraft.decoding.stopping import StopConditions
from quickdraft.drafters import DraftModelDrafter
from quickdraft.drafters.shapes import StaticTree
from quickdraft.models import cpu_kernels
from quickdraft.models.lm import load_model
from quickdraft.models.loading import CheckpointError
from quickdraft.models.placement import PlacementError, resolve_placement
from quickdraft.models.transformer import additive_mask

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="needs the CPU kernels")


def halves(*shape, generator) -> torch.Tensor:
    """Random float32 values that float16 holds exactly."""
    return torch.randn(*shape, generator=generator).half().float()


@pytest.mark.parametrize("d", [64, 20])  # blocks of queries; one query at a time (d % 8 != 0)
@pytest.mark.parametrize("t", [1, 9])  # a step (reads float16 as it goes); a pass (widens each head once)
def test_a_float16_cache_attends_as_float32_over_the_same_values(d, t):
    """Without RoPE, keys and values float16 holds exactly: the float16 cache's attention
    is the float32 cache's, bit for bit, with a tree mask and GQA, and it stores what
    torch's ``.half()`` stores."""
    gen = torch.Generator().manual_seed(d + t)
    hq, hkv, context, max_len = 6, 2, 150, 170
    qkv = halves(t, (hq + 2 * hkv) * d, generator=gen)
    base_k, base_v = halves(hkv, max_len, d, generator=gen), halves(hkv, max_len, d, generator=gen)
    visible = torch.rand(t, context + t, generator=gen) > 0.2
    mask = additive_mask(visible, torch.float32)
    slots = torch.arange(context, context + t)
    outs, caches = {}, {}
    for dtype in (torch.float32, torch.float16):
        k, v, out = base_k.to(dtype), base_v.to(dtype), torch.empty(t, hq * d)
        attend(qkv, None, k, v, slots, context + t, mask, out, hq)
        outs[dtype], caches[dtype] = out, (k, v)
    assert torch.equal(outs[torch.float16], outs[torch.float32])
    for wide, narrow in zip(caches[torch.float32], caches[torch.float16]):
        assert narrow.dtype == torch.float16 and torch.equal(narrow, wide.half())


@pytest.mark.parametrize("d", [64, 20])
def test_a_float16_pass_rounds_each_query_as_its_own_step(d):
    """With RoPE: a causal pass of 9 queries (threads widen the cache) equals nine one-query
    steps (float16 read as they go), bit for bit, with one thread or two; the keys it
    stores are the float32 path's rotated keys rounded to float16."""
    gen = torch.Generator().manual_seed(d)
    hq, hkv, context, t, max_len = 9, 3, 130, 9, 200
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen)
    base_k, base_v = halves(hkv, max_len, d, generator=gen).half(), halves(hkv, max_len, d, generator=gen).half()
    tables = rope_tables(torch.arange(context, context + t), d)
    causal = additive_mask(torch.ones(t, context + t, dtype=torch.bool).tril(context), torch.float32)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            together, alone, (k, v), stepped = pass_and_steps(qkv, tables, base_k, base_v, context, causal, hq)
            assert torch.equal(together, alone), n
            assert torch.equal(k, stepped[0]) and torch.equal(v, stepped[1])
    finally:
        torch.set_num_threads(threads)
    wide_k, wide_v, wide_out = base_k.float(), base_v.float(), torch.empty(t, hq * d)
    attend(qkv, tables, wide_k, wide_v, context, context + t, causal, wide_out, hq)
    assert torch.equal(k, wide_k.half()) and torch.equal(v, wide_v.half())
    torch.testing.assert_close(together, wide_out, atol=2e-2, rtol=2e-2)  # only the new keys' rounding differs


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_a_model_with_a_float16_cache(quantize):
    """The model's cache stores float16 and attends in float32: a prefill equals its
    one-token steps bit for bit; PyTorch's ops (grad enabled: training's path) read the
    same cache to within float rounding; and the logits stay close to a float32 cache's."""
    model = tiny_model(quantize)
    model.kv_dtype = torch.float16
    tokens = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        cache = model.new_cache(1, 42)
        assert cache.k.dtype == cache.v.dtype == torch.float16 and cache.dtype == torch.float32
        prefill = model(tokens, 0, cache).logits[0]
        stepped = model.new_cache(1, 42)
        steps = torch.cat([model(tokens[:, i : i + 1], i, stepped).logits[0] for i in range(40)])
    assert torch.equal(prefill, steps)
    assert torch.equal(cache.k, stepped.k) and torch.equal(cache.v, stepped.v)
    if quantize == "none":  # (the int8 layers run our kernels only: no grad path)
        with torch.no_grad(), torch.enable_grad():
            torch_ops = model(tokens, 0, model.new_cache(1, 42)).logits[0].detach()
        torch.testing.assert_close(torch_ops, prefill, atol=1e-4, rtol=1e-4)
    model.kv_dtype = None
    with torch.inference_mode():
        wide = model(tokens, 0, model.new_cache(1, 42)).logits[0]
    torch.testing.assert_close(prefill, wide, atol=2e-2, rtol=0)


def tokens_of(steps) -> list[int]:
    return [t for s in steps for t in s.tokens]


def test_greedy_speculation_with_a_float16_cache_equals_plain_decoding(tmp_path):
    """Draft chains and trees verified over a float16 cache (both models' caches 16-bit)
    give plain greedy decoding's tokens with the same cache, int8 target included."""
    write_tiny_gguf(tmp_path / "m.gguf", "F32", seed=2)
    for quantize in ("none", "int8"):
        placement = resolve_placement(quantize=quantize, kv_cache="float16")
        target = load_model(tmp_path / "m.gguf", placement=placement)
        draft = load_model(tmp_path / "m.gguf", placement=resolve_placement(kv_cache="float16"))
        prompt = torch.randint(0, 250, (12,), generator=torch.Generator().manual_seed(0))
        reference = tokens_of(decode(target, prompt, StopConditions(60)))
        assert target.cache.k.dtype == torch.float16
        for shape in (None, (3, 2, 2, 1)):
            drafter = DraftModelDrafter(draft, target.vocab_size, None if shape is None else StaticTree(shape))
            out = tokens_of(decode(target, prompt, StopConditions(60), drafter=drafter, num_speculative_tokens=4))
            assert out == reference, (quantize, shape)


def test_batched_rows_over_a_float16_cache_equal_plain_decoding(tmp_path):
    """The batched engine's ragged passes (rows of different lengths, prefilled in chunks
    beside running rows) over a float16 cache: each row's tokens are plain decoding's."""
    from test_batch_engine import run

    from quickdraft.batch_generate import make_batch_engine
    from quickdraft.decoding.sampling import SamplingParams

    write_tiny_gguf(tmp_path / "m.gguf", "F32", seed=2)
    placement = resolve_placement(kv_cache="float16")
    target, draft = load_model(tmp_path / "m.gguf", placement=placement), load_model(tmp_path / "m.gguf")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 250, (n,), generator=gen) for n in (5, 40, 17)]
    engine = make_batch_engine(target, method="draft", draft=draft, max_batch_size=3, max_len=128,
                               num_speculative_tokens=3, prefill_chunk=16)
    assert engine.cache.k.dtype == torch.float16
    out, _ = run(engine, [(p, SamplingParams(), StopConditions(30)) for p in prompts], join_at={2: 2})
    for i, prompt in enumerate(prompts):
        assert out[i] == tokens_of(decode(target, prompt, StopConditions(30))), i


def test_placements_that_cannot_use_it_are_one_line_errors(tmp_path, capsys):
    assert resolve_placement(kv_cache="float16").kv_dtype == torch.float16
    assert resolve_placement(kv_cache="fp16").describe() == "cpu float32, float16 KV cache"
    assert resolve_placement().kv_dtype is None
    for kwargs, says in [({"kv_cache": "int8"}, "unknown --kv-cache 'int8'; use auto, float16"),
                         ({"dtype": "bfloat16", "kv_cache": "float16"}, "16-bit already.*drop --kv-cache")]:
        with pytest.raises(PlacementError, match=says) as err:
            resolve_placement(**kwargs)
        assert "\n" not in str(err.value)
    write_tiny_gguf(tmp_path / "m.gguf", "F32", seed=0)
    with pytest.raises(CheckpointError, match="needs the native runtime.*drop --kv-cache"):
        load_model(tmp_path / "m.gguf", backend="hf", placement=resolve_placement(kv_cache="float16"))
    assert main(["generate", "--prompt", "x", "--dtype", "bfloat16", "--kv-cache", "float16",
                 "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--kv-cache" in err


def test_generate_with_a_float16_cache_from_the_cli(capsys):
    """The embedded pair through the CLI: the same text as plain decoding with that cache."""
    args = ["generate", "--prompt", "def fibonacci(n):", "--max-new-tokens", "24", "--kv-cache", "float16"]
    assert main([*args, "--method", "ar"]) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--method", "draft", "-k", "4"]) == 0
    assert capsys.readouterr().out == plain
