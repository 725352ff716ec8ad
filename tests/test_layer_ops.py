"""The fused layer ops (kernels/layer_ops.c): RMSNorm, the gated MLP's activation and a
row's RoPE + cache write + attention each in one call. They compute what PyTorch's ops
compute (to float rounding), round each query alike whatever else shares the pass (what
lossless speculative decoding needs), and a model running them gives PyTorch's logits."""

import pytest
import torch
import torch.nn.functional as F

from quickdraft.models import cpu_kernels
from quickdraft.models.config import ModelConfig
from quickdraft.models.lm import NativeLM
from quickdraft.models.quant_linear import quantize_linears
from quickdraft.models.transformer import RaggedRow, Transformer, additive_mask, apply_rope

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="needs the compiled CPU kernels (cc, AVX2)")


@pytest.mark.parametrize("width", [8, 37, 576])
def test_rms_norm_and_silu_mul_match_pytorch(width):
    gen = torch.Generator().manual_seed(width)
    x, w = torch.randn(5, width, generator=gen), torch.randn(width, generator=gen)
    torch.testing.assert_close(cpu_kernels.rms_norm(x, w, 1e-5), F.rms_norm(x, (width,), w, 1e-5))
    # No weight: a unit one, bit for bit (an EAGLE drafter's feature map takes it).
    assert torch.equal(cpu_kernels.rms_norm(x, None, 1e-6), cpu_kernels.rms_norm(x, torch.ones(width), 1e-6))
    h = torch.randn(2, 3, 2 * width, generator=gen) * 6  # far into silu's tails too
    torch.testing.assert_close(cpu_kernels.silu_mul(h), F.silu(h[..., :width]) * h[..., width:])


def attend(qkv, rope, k_cache, v_cache, slots, kv_len, mask, out, n_heads):
    """``cpu_kernels.attend`` on one layer's, one row's cache ``[H_kv, max_len, D]``."""
    cpu_kernels.attend(qkv, rope, k_cache[None, None], v_cache[None, None], 0, 0, slots, kv_len, mask, out, n_heads)


def rope_tables(positions: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.outer(positions.double(), 1.0 / 10000 ** (torch.arange(0, dim, 2).double() / dim))
    return torch.cat((freqs, freqs), -1).cos().float(), torch.cat((-freqs.sin(), freqs.sin()), -1).float()


def reference(qkv, cos, sin, k_cache, v_cache, slots, kv_len, mask, hq):
    """PyTorch's RoPE, cache write and SDPA, as the model's unfused path runs them."""
    hkv, _, d = k_cache.shape
    t = qkv.shape[0]
    heads = qkv.view(t, hq + 2 * hkv, d).transpose(0, 1)[None]  # [1, H, T, D]
    qk = heads[:, : hq + hkv] if cos is None else apply_rope(heads[:, : hq + hkv], cos[None, None], sin[None, None])
    q, k, v = qk[:, :hq], qk[:, hq:], heads[:, hq + hkv :]
    k_cache[:, slots], v_cache[:, slots] = k[0], v[0]
    out = F.scaled_dot_product_attention(q, k_cache[None, :, :kv_len], v_cache[None, :, :kv_len],
                                         attn_mask=None if mask is None else mask[None, None], enable_gqa=hq != hkv)
    return out[0].transpose(0, 1).reshape(t, hq * d)


@pytest.mark.parametrize("hq,hkv,d,rope", [(6, 2, 64, True), (4, 4, 12, True), (3, 3, 8, False)])
def test_attend_matches_pytorch_with_tree_slots_and_mask(hq, hkv, d, rope):
    gen = torch.Generator().manual_seed(d)
    context, t, max_len = 21, 7, 40
    k_cache, v_cache = torch.randn(hkv, max_len, d, generator=gen), torch.randn(hkv, max_len, d, generator=gen)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen)
    slots = torch.arange(context, context + t)
    positions = torch.tensor([context, context + 1, context + 1, context + 2, context + 2, context + 3, context + 3])
    tables = rope_tables(positions, d) if rope else None
    visible = torch.ones(t, context + t, dtype=torch.bool)  # a token tree: each node sees its ancestors
    parents = [-1, 0, 0, 1, 2, 3, 4]
    visible[:, context:] = False
    for node in range(t):
        walk = node
        while walk >= 0:
            visible[node, context + walk] = True
            walk = parents[walk]
    mask = additive_mask(visible, torch.float32)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    want = reference(qkv, *(tables or (None, None)), ref_k, ref_v, slots, context + t, mask, hq)
    out = torch.empty(t, hq * d)
    attend(qkv, tables, k_cache, v_cache, slots, context + t, mask, out, hq)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)
    assert torch.equal(k_cache[:, :context], ref_k[:, :context]) and torch.equal(v_cache, ref_v)
    torch.testing.assert_close(k_cache, ref_k)


@pytest.mark.skipif(cpu_kernels.library() is None, reason="needs the compiled kernels")
@pytest.mark.parametrize("hq,hkv,d,half", [(7, 7, 64, False), (6, 2, 64, True), (4, 4, 12, False)])
def test_attend_without_a_mask_is_causal_bit_for_bit(hq, hkv, d, half):
    """A pass with no mask (a chain or a prefill on our kernels: none is built) is causal,
    each query seeing the slots up to its own, with the causal mask's result bit for bit:
    contiguous slots and explicit ones, float32 and float16 caches, a head size that is not
    a multiple of 8 (the one-query-at-a-time path), 2 threads. Attending to every slot
    instead (what no mask meant before) fails it."""
    gen = torch.Generator().manual_seed(hq * d)
    context, t, max_len = 45, 13, 80
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen)
    dtype = torch.float16 if half else torch.float32
    base_k = torch.randn(hkv, max_len, d, generator=gen).to(dtype)
    base_v = torch.randn(hkv, max_len, d, generator=gen).to(dtype)
    tables = rope_tables(torch.arange(context, context + t), d)
    causal = torch.ones(t, context + t, dtype=torch.bool).tril(context)
    for slots in (context, torch.arange(context, context + t)):
        got, want = torch.empty(t, hq * d), torch.empty(t, hq * d)
        k, v = base_k.clone(), base_v.clone()
        attend(qkv, tables, k, v, slots, context + t, additive_mask(causal, torch.float32), want, hq)
        k2, v2 = base_k.clone(), base_v.clone()
        attend(qkv, tables, k2, v2, slots, context + t, None, got, hq)
        assert torch.equal(got, want) and torch.equal(k2, k) and torch.equal(v2, v)
    # a one-token step without a mask still sees every slot
    one = torch.empty(1, hq * d)
    attend(qkv[:1], (tables[0][:1], tables[1][:1]), base_k.clone(), base_v.clone(), context, context + 1, None, one, hq)
    assert torch.equal(one, want[:1])


def test_a_tree_node_rounds_as_the_plain_step_after_its_path_is_accepted():
    """A tree node sees the cache and its ancestors at scattered slots; once its path is
    accepted, the same keys sit packed behind the cache and a one-query step attends over
    them. Both must round alike, bit for bit (with 8-bit activations one ulp of difference
    can move a rounding step and change the greedy token)."""
    gen = torch.Generator().manual_seed(1)
    hq, hkv, d, context, max_len = 9, 3, 64, 37, 80
    parents = [-1, 0, 0, 1, 2, 3, 4, 5, 1, 6, 9]  # node 10's path: 0, 2, 4, 6, 9, 10
    t = len(parents)
    depth = [0] * t
    for node in range(1, t):
        depth[node] = depth[parents[node]] + 1
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen)
    base_k, base_v = torch.randn(hkv, max_len, d, generator=gen), torch.randn(hkv, max_len, d, generator=gen)
    visible = torch.zeros(t, context + t, dtype=torch.bool)
    visible[:, :context] = True
    for node in range(t):
        walk = node
        while walk >= 0:
            visible[node, context + walk] = True
            walk = parents[walk]
    tables = rope_tables(context + torch.tensor(depth), d)
    k, v = base_k.clone(), base_v.clone()
    tree = torch.empty(t, hq * d)
    attend(qkv, tables, k, v, torch.arange(context, context + t), context + t, additive_mask(visible, torch.float32),
           tree, hq)
    for node in range(t):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        packed_k, packed_v = base_k.clone(), base_v.clone()
        for i, n in enumerate(path[:-1]):  # accepted ancestors, packed behind the cache
            packed_k[:, context + i], packed_v[:, context + i] = k[:, context + n], v[:, context + n]
        step = torch.empty(1, hq * d)
        slot = context + len(path) - 1
        attend(qkv[node : node + 1], tuple(x[node : node + 1] for x in tables), packed_k, packed_v, slot, slot + 1,
               None, step, hq)
        assert torch.equal(step[0], tree[node]), node


def pass_and_steps(qkv, tables, base_k, base_v, context, causal, hq):
    """The t queries of ``qkv`` after ``context`` cache slots as one causal pass and as t
    one-query steps, each on its own copy of the cache: (the pass's output, the steps'
    output, the pass's (keys, values), the steps' (keys, values))."""
    t, d = qkv.shape[0], base_k.shape[-1]
    k, v = base_k.clone(), base_v.clone()
    together = torch.empty(t, hq * d)
    attend(qkv, tables, k, v, context, context + t, causal, together, hq)
    k2, v2 = base_k.clone(), base_v.clone()
    alone = torch.empty(t, hq * d)
    for j in range(t):
        attend(qkv[j : j + 1], tuple(x[j : j + 1] for x in tables), k2, v2, context + j, context + j + 1, None,
               alone[j : j + 1], hq)
    return together, alone, (k, v), (k2, v2)


@pytest.mark.parametrize("d", [64, 72, 20])  # blocks of queries (72: 64 + 8 output floats), one at a time (20)
def test_attend_rounds_each_query_alike_whatever_shares_the_pass(d):
    """A causal pass of 9 queries equals nine one-query steps bit for bit, with one thread
    or two, and a query that sees no slot gets zeros (SDPA would give NaN)."""
    gen = torch.Generator().manual_seed(0)
    hq, hkv, context, t, max_len = 9, 3, 130, 9, 200
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen)
    base_k, base_v = torch.randn(hkv, max_len, d, generator=gen), torch.randn(hkv, max_len, d, generator=gen)
    tables = rope_tables(torch.arange(context, context + t), d)
    causal = additive_mask(torch.ones(t, context + t, dtype=torch.bool).tril(context), torch.float32)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            together, alone, _, _ = pass_and_steps(qkv, tables, base_k, base_v, context, causal, hq)
            assert torch.equal(together, alone)
            results.append(together)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])
    hidden = torch.full((1, context + 1), float("-inf"))
    out = torch.full((1, hq * d), 7.0)
    attend(qkv[:1], None, base_k.clone(), base_v.clone(), context, context + 1, hidden, out, hq)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.skipif(cpu_kernels.library() is not None and cpu_kernels.kernel_isa() != "avx512",
                    reason="needs AVX-512 (the AVX2 path is the reference)")
@pytest.mark.parametrize("d", [64, 128, 48])  # 64-float slices; two of them; a 48-float one
def test_attention_on_avx512_rounds_as_on_avx2(d):
    """Blocks of queries sum their values on AVX-512 (kernels/attend_avx512.c), sharing each
    value between the block's queries: the same result as AVX2's per-query sums bit for bit,
    with keys a tree mask hides, weights that underflow to 0 (skipped by both) and a query
    that sees no key (zeros)."""
    gen = torch.Generator().manual_seed(d)
    hq, hkv, context, t, max_len = 6, 2, 203, 9, 220
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen) * 8  # scores spread wide enough to underflow
    base_k, base_v = torch.randn(hkv, max_len, d, generator=gen) * 8, torch.randn(hkv, max_len, d, generator=gen)
    visible = torch.rand(t, context + t, generator=gen) > 0.3
    visible[3] = False
    mask = additive_mask(visible, torch.float32)
    results = {}
    try:
        for isa in ("avx2", "avx512"):
            cpu_kernels.kernel_isa(isa)
            k, v, out = base_k.clone(), base_v.clone(), torch.empty(t, hq * d)
            attend(qkv, None, k, v, context, context + t, mask, out, hq)
            results[isa] = out
    finally:
        cpu_kernels.kernel_isa("avx512")
    assert torch.equal(results["avx2"], results["avx512"])
    assert torch.equal(results["avx2"][3], torch.zeros(hq * d))
    keys = k[:, : context + t].repeat_interleave(hq // hkv, 0)  # [hq, slots, d]
    scores = torch.einsum("thd,hsd->ths", qkv[:, : hq * d].view(t, hq, d), keys) / d**0.5
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    gap = scores.amax(-1, keepdim=True) - scores
    assert (visible[:, None] & (gap > 110)).any()  # some weights underflow (e^-110 < 2^-149)


@pytest.mark.skipif(cpu_kernels.library() is not None and cpu_kernels.kernel_isa() != "avx512",
                    reason="needs AVX-512 (the AVX2 path is the reference)")
@pytest.mark.parametrize("t", [1, 5])
def test_softmax_on_avx512_sums_as_on_avx2(t):
    """On AVX-512 the softmax numerators are computed 16 at a time and added to the 8 lane
    sums half by half, in the AVX2 loop's order: with scores close together (every key
    weighs in the total, so its rounding shows in the output) both give the same output bit
    for bit, for one query and for a block."""
    gen = torch.Generator().manual_seed(t)
    hq, hkv, d, context, max_len = 4, 2, 64, 301, 320
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen) * 0.3
    base_k, base_v = torch.randn(hkv, max_len, d, generator=gen), torch.randn(hkv, max_len, d, generator=gen)
    causal = additive_mask(torch.ones(t, context + t, dtype=torch.bool).tril(context), torch.float32)
    results = {}
    try:
        for isa in ("avx2", "avx512"):
            cpu_kernels.kernel_isa(isa)
            out = torch.empty(t, hq * d)
            attend(qkv, None, base_k.clone(), base_v.clone(), context, context + t, causal, out, hq)
            results[isa] = out
    finally:
        cpu_kernels.kernel_isa("avx512")
    assert torch.equal(results["avx2"], results["avx512"])


def count_calls(monkeypatch, name: str) -> dict[str, int]:
    """Count the calls of ``cpu_kernels.<name>`` (the real function still runs)."""
    calls, real = {name: 0}, getattr(cpu_kernels, name)

    def counted(*args, **kwargs):
        calls[name] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_kernels, name, counted)
    return calls


def tiny_model(quantize: str = "none", int8_head: bool = False) -> Transformer:
    from quickdraft.models.quant_linear import quantize_head

    torch.manual_seed(0)
    config = ModelConfig(family="llama", model_type="llama", vocab_size=96, hidden_size=64, n_layers=2, n_heads=4,
                         n_kv_heads=2, head_dim=16, intermediate_size=96, max_position_embeddings=64)
    model = Transformer(config).eval()
    if quantize != "none":
        quantize_linears(model, quantize)
    if int8_head:
        assert quantize_head(model)
    NativeLM(model)  # the decode linears, as loading does: row-invariant products
    return model


def test_model_runs_the_fused_ops_and_matches_pytorch(monkeypatch):
    model = tiny_model()
    config = model.config
    monkeypatch.setattr(type(model.layers[0]), "kernel_specs", lambda self: None)  # the per-op path, not one call
    tokens = torch.randint(0, 96, (1, 12))
    def run() -> list[torch.Tensor]:
        with torch.inference_mode():
            cache = model.new_cache(1, 32)
            prefill = model(tokens[:, :8], 0, cache).logits
            verify = model(tokens[:, 8:12], 8, cache).logits
            step = model(tokens[:, 8:9], 8, cache).logits  # the verify pass's first token alone
        return [prefill, verify, step]

    calls = count_calls(monkeypatch, "attend")
    fused = run()
    assert calls["attend"] == 3 * config.n_layers
    assert torch.equal(fused[1][:, 0], fused[2][:, 0])  # a verify row is a plain step, bit for bit
    monkeypatch.setattr(cpu_kernels, "fused_layers", lambda x: False)
    plain = run()
    assert calls["attend"] == 3 * config.n_layers  # PyTorch's path this time
    for got, want in zip(fused, plain):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_batched_and_ragged_passes_match_pytorch(monkeypatch):
    """Rows of different lengths (tensor positions and slots, batch 2) and a packed ragged
    pass (rows in their own cache rows, padding after them) give PyTorch's results."""
    model = tiny_model()
    tokens = torch.randint(0, 96, (2, 10))

    def run() -> list[torch.Tensor]:
        with torch.inference_mode():
            cache = model.new_cache(2, 32)
            model(tokens[:, :6], 0, cache, logits="none")
            positions = torch.tensor([[6, 7, 8], [4, 5, 6]])  # row 1 rewinds to 4 tokens
            batched = model(tokens[:, 6:9], positions, cache).logits
            rows = [RaggedRow(0, 9, 1, 0), RaggedRow(1, 7, 3, 1)]
            packed = torch.cat([tokens[0, 9:10], tokens[1, 7:10], torch.zeros(2, dtype=torch.long)])[None]
            ragged_positions = torch.tensor([[9, 7, 8, 9, 0, 0]])
            ragged = model(packed, ragged_positions, cache, ragged=rows).logits
        return [batched, ragged[:, :4], cache.k.clone()]

    fused = run()
    monkeypatch.setattr(cpu_kernels, "fused_layers", lambda x: False)
    for got, want in zip(fused, run()):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("quantize", ["none", "int4", "int8"])
def test_a_whole_block_in_one_call_is_the_per_op_path_bit_for_bit(quantize, monkeypatch):
    """Where every linear of a block runs on our kernels (float32, int8 or int4), the block
    is one C call (cpu_kernels.block), and all the model's blocks together one call
    (cpu_kernels.blocks): the same kernels in the same order, so the same bits."""
    model = tiny_model(quantize)
    assert all(block.kernel_specs() is not None for block in model.layers)
    tokens = torch.randint(0, 96, (1, 14))
    def run() -> list[torch.Tensor]:
        with torch.inference_mode():
            cache = model.new_cache(1, 32)
            prefill = model(tokens[:, :8], 0, cache).logits
            tree = torch.tensor([[True, False, False], [True, True, False], [True, False, True]])
            mask = torch.cat([torch.ones(3, 8, dtype=torch.bool), tree], -1)[None]
            branch = model(tokens[:, 8:11], torch.tensor([[8, 9, 9]]), cache, mask=mask).logits
            verify = model(tokens[:, 8:14], 8, cache).logits
            step = model(tokens[:, 8:9], 8, cache).logits
        return [prefill, branch, verify, step]

    stacks, calls = count_calls(monkeypatch, "blocks"), count_calls(monkeypatch, "block")
    stacked = run()
    assert stacks["blocks"] == 4 and calls["block"] == 0
    assert torch.equal(stacked[2][:, 0], stacked[3][:, 0])
    monkeypatch.setattr(type(model), "block_stack", lambda self, start, stop: None)
    whole = run()
    assert stacks["blocks"] == 4 and calls["block"] == 4 * model.config.n_layers
    monkeypatch.setattr(type(model.layers[0]), "kernel_specs", lambda self: None)
    per_op = run()
    assert calls["block"] == 4 * model.config.n_layers
    for got, want, alone in zip(stacked, whole, per_op):
        assert torch.equal(got, want) and torch.equal(got, alone)


@pytest.mark.parametrize("quantize", ["none", "int4", "int8"])
def test_a_prefill_of_many_rows_rounds_each_token_as_its_own_step(quantize):
    """A pass of 64+ rows (a prefill) splits its per-row work (quantizing x, norms, SiLU,
    residuals, RoPE and cache writes) and its products (two tiles a pass from 25 rows)
    between the threads: each token's logits equal a one-token step's after the tokens
    before it, bit for bit, with one thread or two."""
    model = tiny_model(quantize)
    n = 64  # MANY_ROWS (kernels/qmatmul.h), all the tiny model's positions
    tokens = torch.randint(0, 96, (1, n), generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            with torch.inference_mode():
                cache = model.new_cache(1, n + 2)
                prefill = model(tokens, 0, cache).logits[0]
                cache = model.new_cache(1, n + 2)
                steps = torch.cat([model(tokens[:, i : i + 1], i, cache).logits[0] for i in range(n)])
            assert torch.equal(prefill, steps)
            results.append(prefill)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("quantize", ["none", "int4", "int8"])
def test_a_ragged_pass_in_one_call_is_the_per_op_row_loop_bit_for_bit(quantize, monkeypatch):
    """The batched engine's ragged passes (rows packed one after another, each attending in
    its own cache row, over its own slots, with its own causal mask) run all blocks in one
    C call too (cpu_kernels.blocks_ragged), and a pass of one row the whole model in one
    call (Transformer.forward_call, at that cache row): logits and caches equal the per-op
    path's row loop bit for bit, prefills and mixed-width steps in any row order, hidden
    states kept."""
    from quickdraft.models.ragged import Feed, ragged_forward, ragged_forward_keeping

    model = tiny_model(quantize)
    torch.manual_seed(1)
    prompts = [torch.randint(0, 96, (n,)) for n in (9, 4, 12, 1)]
    widths = [1, 5, 3, 2]

    def run() -> list[torch.Tensor]:
        cache = model.new_cache(len(prompts), 40)
        prefill = ragged_forward(model, cache, [Feed(s, 0, ids, 2) for s, ids in enumerate(prompts)])
        step = ragged_forward(model, cache, [Feed(s, prompts[s].numel(), torch.arange(3, 3 + widths[s]), widths[s])
                                             for s in (2, 0, 3, 1)])
        alone = ragged_forward(model, cache, [Feed(1, prompts[1].numel() + widths[1], torch.tensor([7]), 1)])
        kept, states = ragged_forward_keeping(model, cache, [Feed(0, 10, torch.tensor([5, 6]), 2),
                                                             Feed(3, 3, torch.tensor([8]), 1)], (1, 2))
        final = model.config.n_layers
        lone, lone_states = ragged_forward_keeping(model, cache, [Feed(3, 4, torch.tensor([9, 10, 11]), 2)],
                                                   (1, final))  # (an EAGLE-3 drafter's)
        return [*prefill, *step, *alone, *kept, *(t for row in states for t in row.values()), *lone,
                lone_states[0][1], lone_states[0][final], cache.k, cache.v]

    calls = count_calls(monkeypatch, "blocks_ragged")
    one_calls = []
    real_call = cpu_kernels.ForwardCall.__call__

    def one_call(self, *args, **kwargs):
        one_calls.append(args[-1])  # the cache row
        return real_call(self, *args, **kwargs)

    monkeypatch.setattr(cpu_kernels.ForwardCall, "__call__", one_call)
    stacked = run()
    assert calls["blocks_ragged"] == 2 + 2  # the kept states' pass: one call per stretch between them
    assert one_calls == [1, 3]  # the lone rows' passes
    monkeypatch.setattr(type(model), "block_stack", lambda self, start, stop: None)
    per_op = run()
    assert calls["blocks_ragged"] == 4 and one_calls == [1, 3]
    monkeypatch.undo()
    with pytest.raises(ValueError, match="exceeds the KV cache"):  # a lone row past its cache: the same error
        ragged_forward(model, model.new_cache(2, 8), [Feed(1, 6, torch.tensor([1, 2, 3]), 1)])
    for got, want in zip(stacked, per_op, strict=True):
        assert torch.equal(got, want)


def test_block_specs_follow_swapped_layers_and_copies():
    """The specs point into the layers' tensors: a swapped layer gets new ones, and a
    copied model its own (never pointers into the original's weights)."""
    import copy

    model = tiny_model("int8")
    model.lm_head = torch.nn.Linear(64, 96)  # oneDNN's opaque head cannot be deep-copied
    block = model.layers[0]
    first = block.kernel_specs()
    assert block.kernel_specs() is first
    twin = copy.deepcopy(model)
    assert twin.layers[0].kernel_specs()[0].q == twin.layers[0].attn.wqkv.tiles.data_ptr() != first[0].q
    quantize_linears(block, "int4")  # nothing left to swap: still int8
    block.attn.wo = tiny_model("int4").layers[0].attn.wo
    assert block.kernel_specs() is not first and block.kernel_specs()[1].kind == cpu_kernels.LINEAR_KINDS["q4"]


def greedy_steps(lm: NativeLM, first: int, n: int, vocab: int) -> list[int]:
    """``n`` greedy tokens after ``first``, one ``extend`` and one ``argmax`` at a time."""
    from quickdraft.drafters.draft_model import present_logits

    tokens = [first]
    for _ in range(n):
        logits = lm.extend(torch.tensor([tokens[-1]]), logits="last")
        tokens.append(int(present_logits(logits, vocab)[-1].argmax()))
    return tokens


@pytest.mark.parametrize("quantize", ["none", "int8", "int4", "restricted"])
def test_a_greedy_chain_in_one_call_is_step_by_step_decoding(quantize):
    """NativeLM.greedy_chain (the draft's greedy steps in one C call: embedding, blocks,
    final norm, head, argmax) gives the tokens and the KV cache of one-token extends and
    torch.argmax, bit for bit: float32, int8 and int4 blocks (the int8 case with an int8
    head), a restricted head (FR-Spec ids), and a target vocabulary smaller or larger
    than the draft's."""
    from quickdraft.models.quant_linear import quantize_head

    torch.manual_seed(0)
    config = ModelConfig(family="llama", model_type="llama", vocab_size=96, hidden_size=64, n_layers=2, n_heads=4,
                         n_kv_heads=2, head_dim=16, intermediate_size=96, max_position_embeddings=64)
    model = Transformer(config).eval()
    if quantize in ("int8", "int4"):
        quantize_linears(model, quantize)
    if quantize == "int8":
        assert quantize_head(model)
    if quantize == "restricted":
        model.restrict_head(torch.randperm(96)[:40])
    prompt = torch.randint(0, 96, (7,))
    for vocab in (96, 50, 120):
        chained, stepped = NativeLM(model), NativeLM(model)
        with torch.inference_mode():
            for lm in (chained, stepped):
                lm.reset(32)
                lm.extend(prompt, logits="none")
            got = chained.greedy_chain(3, 12, vocab)
            assert got is not None, "the one-call path should run on this model"
            assert got == greedy_steps(stepped, 3, 12, vocab), (quantize, vocab)
        assert chained.length == stepped.length == 19
        assert torch.equal(chained.cache.k[:, :, :, :19], stepped.cache.k[:, :, :, :19])
        assert torch.equal(chained.cache.v[:, :, :, :19], stepped.cache.v[:, :, :, :19])
    with torch.inference_mode():  # no room for the chain: nothing fed, the caller steps
        assert chained.greedy_chain(3, 32 - 19 + 1, 96) is None and chained.length == 19
    # With a feed (what the draft has not seen: one token, or several after an acceptance)
    # in the same call: the tokens and cache of an extend over them, its argmax, the steps.
    from quickdraft.drafters.draft_model import present_logits

    for feed in (torch.tensor([3]), torch.tensor([3, 17, 60, 5])):
        chained, stepped = NativeLM(model), NativeLM(model)
        with torch.inference_mode():
            for lm in (chained, stepped):
                lm.reset(32)
                lm.extend(prompt, logits="none")
            got = chained.greedy_chain(None, 10, 96, feed=feed)
            assert got is not None, "the one-call path should run on this model"
            first = int(present_logits(stepped.extend(feed, logits="last"), 96)[-1].argmax())
            assert got == greedy_steps(stepped, first, 10, 96), (quantize, feed)
        n = 7 + feed.numel() + 10
        assert chained.length == stepped.length == n
        assert torch.equal(chained.cache.k[:, :, :, :n], stepped.cache.k[:, :, :, :n])
        assert torch.equal(chained.cache.v[:, :, :, :n], stepped.cache.v[:, :, :, :n])


@pytest.mark.parametrize("case", ["none", "int8", "int4", "kv16", "restricted"])
def test_a_pass_in_one_call_is_the_model_forward_bit_for_bit(case, monkeypatch):
    """NativeLM.extend runs a contiguous pass (a prefill, a plain step, a chain's verify
    pass) as one C call (Transformer.forward_call: embedding, blocks, final norm, head)
    with the logits, final hidden states and KV cache of Transformer.forward, bit for
    bit: float32, int8 (with an int8 head) and int4 blocks, a float16 KV cache, and the
    states of other layers beside (an EAGLE-3 drafter's). A restricted head, the
    embedding's output and a token the embedding lacks take forward."""
    model = tiny_model(case if case in ("int8", "int4") else "none", int8_head=case == "int8")
    if case == "kv16":
        model.kv_dtype = torch.float16
    if case == "restricted":
        model.restrict_head(torch.randperm(96)[:40])
    final = model.config.n_layers
    tokens = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(2))

    def run(one_call: bool) -> tuple[list[torch.Tensor], NativeLM]:
        lm = NativeLM(model)
        lm.reset(32)
        if not one_call:
            lm.one_call = None  # "cannot run here": Transformer.forward
        out = [lm.extend(tokens[:8], logits="all", output_hidden_states=(final,)), lm.hidden_states[final]]
        out.append(lm.extend(tokens[8:12], logits=3, output_hidden_states=(final,)))
        out += [lm.hidden_states[final], lm.extend(tokens[12:13], logits="last")]
        assert lm.extend(tokens[13:16], logits="none") is None
        out += [lm.extend(tokens[16:20], logits=9), lm.cache.k[:, :, :, :20].clone(), lm.cache.v[:, :, :, :20].clone()]
        assert lm.length == 20
        return out, lm

    def fused_states(lm: NativeLM) -> list[torch.Tensor]:  # an EAGLE-3 drafter's (layer 1 and the final)
        with torch.inference_mode():
            out = [lm.extend(tokens[:3], logits="last", output_hidden_states=(1, final))]
        return out + [lm.hidden_states[layer] for layer in (1, final)]

    forwards = count_calls(monkeypatch, "blocks")
    one, lm = run(one_call=True)
    one += fused_states(lm)
    assert (lm.one_call is None) == (case == "restricted")
    ran_forward = forwards["blocks"]
    assert ran_forward == (5 + 2 if case == "restricted" else 0)  # (2 stretches)
    reference, reference_lm = run(one_call=False)
    reference += fused_states(reference_lm)
    assert forwards["blocks"] == ran_forward + 5 + 2
    for got, want in zip(one, reference, strict=True):
        assert got.shape == want.shape and torch.equal(got, want)
    with torch.inference_mode():  # the embedding's output (state 0): forward
        lm.extend(tokens[:2], logits="last", output_hidden_states=(0,))
    assert forwards["blocks"] == ran_forward + 5 + 2 + 1 and lm.length == 25
    with pytest.raises(IndexError):  # a token the embedding lacks: forward's error, nothing fed
        lm.extend(torch.tensor([3, 96]), logits="last")
    assert lm.length == 25


def test_the_draft_model_drafts_greedy_chains_in_one_call(monkeypatch):
    """A greedy chain drafter takes the one-call path, and proposes what its Python loop does."""
    from quickdraft.decoding.sampling import SamplingParams
    from quickdraft.drafters.draft_model import DraftModelDrafter

    model = tiny_model()
    sequence = torch.randint(0, 96, (9,))
    proposals = []
    for one_call in (True, False):
        if not one_call:
            monkeypatch.setattr(NativeLM, "greedy_chain", lambda *args, **kwargs: None)
        calls = count_calls(monkeypatch, "greedy_chain")
        drafter = DraftModelDrafter(NativeLM(model), 96)
        # (Outside inference mode, as the engine calls it: the one-call path enters it itself.)
        drafter.join(0, sequence, SamplingParams(), torch.Generator(), 48)
        first = drafter.propose([0], [sequence], [6])[0]
        drafter.verified(0, 9, [0, 1, 2])  # three accepted, then the target's token
        longer = torch.cat([sequence, first.tokens[:3], torch.tensor([5])])
        second = drafter.propose([0], [longer], [6])[0]
        single = DraftModelDrafter(NativeLM(model), 96)  # k = 1: the catch-up and one token, in the call too
        single.join(0, sequence, SamplingParams(), torch.Generator(), 48)
        one = single.propose([0], [sequence], [1])[0]
        assert calls["greedy_chain"] == (3 if one_call else 0)
        proposals.append((first.tokens.tolist(), first.parents.tolist(), second.tokens.tolist(), one.tokens.tolist()))
    assert proposals[0] == proposals[1]
    assert len(proposals[0][0]) == 6 and proposals[0][1] == [-1, 0, 1, 2, 3, 4] and len(proposals[0][3]) == 1


def test_step_costs_time_the_draft_burst_as_the_drafter_runs_it(monkeypatch):
    """The cost model's draft burst is timed the way DraftModelDrafter drafts a greedy
    chain: its catch-up and steps in one greedy_chain call (else extends); and t_ar, a
    plain step, the way the engine decodes plain greedy text: a token of the target's
    greedy chain of engine.PLAIN_CHAIN (else a one-token extend)."""
    from quickdraft.decoding.engine import PLAIN_CHAIN
    from quickdraft.policy.autok import StepCostSampler

    target, draft = NativeLM(tiny_model()), NativeLM(tiny_model())
    context = torch.randint(0, 96, (20,))
    calls = count_calls(monkeypatch, "greedy_chain")
    lengths = []
    real_chain = NativeLM.greedy_chain

    def chain(self, *args, **kwargs):
        tokens = real_chain(self, *args, **kwargs)
        lengths.append((self is target, len(tokens)))
        return tokens

    monkeypatch.setattr(NativeLM, "greedy_chain", chain)
    sampler = StepCostSampler(target, draft, context, verify_sizes=(1, 2, 5))
    sampler.sample(2)
    # a burst before each verify pass (widths 2 and 5), a plain chain of the target's each round
    assert calls["greedy_chain"] == 2 * 2 + 2
    assert lengths.count((True, PLAIN_CHAIN)) == 2 and len(sampler.plain_times) == 2
    costs = sampler.costs()
    assert sorted(costs.draft_burst) == [1, 2, 3, 4]
    times = [costs.draft_burst[j] for j in range(1, 5)]
    assert all(0 < a < b for a, b in zip(times, times[1:]))
    assert 0 < costs.t_ar != costs.verify[1]
    monkeypatch.setattr(NativeLM, "greedy_chain", lambda *args, **kwargs: None)  # no one-call path: extends
    sampler = StepCostSampler(target, draft, context, verify_sizes=(1, 2, 5))
    sampler.sample(1)
    assert calls["greedy_chain"] == 6 and sampler.costs().t_ar == sampler.costs().verify[1]


def test_states_between_layers_keep_the_blocks_in_c_calls_bit_for_bit(monkeypatch):
    """A pass asked for a middle layer's state (an EAGLE-3 drafter's fused layers) runs the
    blocks as one C call per stretch between the states asked for, not layer by layer in
    Python: the same states and logits, bit for bit, as the per-block path."""
    model = tiny_model()
    tokens = torch.randint(0, 96, (1, 12))

    def run() -> list[torch.Tensor]:
        with torch.inference_mode():
            cache = model.new_cache(1, 32)
            prefill = model(tokens[:, :8], 0, cache, output_hidden_states=(1, 2))
            verify = model(tokens[:, 8:12], 8, cache, output_hidden_states=(1, 2))
        return [prefill.logits, prefill.hidden_states[1], prefill.hidden_states[2], verify.logits,
                verify.hidden_states[1], verify.hidden_states[2]]

    stacks, calls = count_calls(monkeypatch, "blocks"), count_calls(monkeypatch, "block")
    stacked = run()
    assert stacks["blocks"] == 2 * 2 and calls["block"] == 0  # two passes, two stretches each
    monkeypatch.setattr(type(model), "block_stack", lambda self, start, stop: None)
    per_block = run()
    assert calls["block"] == 2 * model.config.n_layers
    for got, want in zip(stacked, per_block):
        assert torch.equal(got, want)


@pytest.mark.skipif(cpu_kernels.library() is None, reason="needs the compiled kernels")
def test_argmax_rows_picks_what_torch_argmax_picks():
    """The kernel's argmax (greedy verification and plain greedy steps on the CPU) gives
    torch.argmax's ids: the first of tied maxima, the first NaN over any number, 0 for a row
    of -inf, -0 and +0 alike; rows of any length (a tail past the 8-lane sweep), views."""
    gen = torch.Generator().manual_seed(0)
    for shape in [(13, 8192), (1, 8192), (3, 49152), (5, 13), (2, 7), (4, 1), (8192,)]:
        x = torch.randn(*shape, generator=gen)
        assert cpu_kernels.argmax_rows(x) == x.argmax(-1).reshape(-1).tolist()
    x = torch.randn(7, 100, generator=gen)
    x[0, 40] = x[0, 70] = float("nan")
    x[1] = float("-inf")
    x[2, 5] = x[2, 50] = x[2, 97] = 100.0  # ties: the first
    x[3] = 0.0
    x[3, 0] = -0.0
    x[4, 98] = x[4, 99] = float("inf")
    x[5, 99] = float("nan")  # a NaN in the tail past the vector sweep
    x[6, 96] = x[6, 99] = 50.0  # tied in the tail
    got = cpu_kernels.argmax_rows(x)
    assert got == x.argmax(-1).tolist() == [40, 0, 5, 0, 98, 99, 96]
    view = torch.randn(6, 40, generator=gen)[::2, 3:33]  # strided rows
    assert cpu_kernels.argmax_rows(view) == view.argmax(-1).tolist()
    assert cpu_kernels.argmax_rows(x.double()) is None  # other dtypes: torch's


def spread_argmax(logits: torch.Tensor, ids: torch.Tensor | None, vocab: int) -> int:
    """torch.argmax over ``logits`` spread into the vocabulary (-inf elsewhere, ids at or
    beyond ``vocab`` dropped): what a greedy chain's head must pick (of a head all -inf, its
    smallest id)."""
    full = torch.full((vocab,), float("-inf"))
    names = torch.arange(logits.numel()) if ids is None else ids
    keep = names < vocab
    full[names[keep]] = logits[keep]
    if keep.any() and bool((logits[keep] == float("-inf")).all()):
        return int(names[keep].min())
    return int(full.argmax())


@pytest.mark.skipif(cpu_kernels.library() is None, reason="needs the compiled kernels")
def test_chain_argmax_picks_the_smallest_id_of_the_maximum():
    """A chain's head argmax (qd_argmax_ids: a vector sweep for the maximum, then the ids
    holding it) is torch.argmax over the logits spread into the vocabulary: ties go to the
    smaller id whatever order the head's rows name them in, a NaN is above all (the smallest
    NaN id), ids at or beyond the vocabulary never win, a tail past the sweep counts."""
    gen = torch.Generator().manual_seed(0)
    vocab = 600
    for n in (2048, 517, 13, 7):
        ids = torch.randperm(vocab, generator=gen)[:n] if n < vocab else None
        logits = torch.randn(n, generator=gen)
        cases = [logits.clone() for _ in range(6)]
        cases[1][[3, n - 1]] = 9.0  # a tie, one in the tail
        cases[2][[1, n - 2]] = float("nan")
        cases[3][:] = float("-inf")
        cases[4][[0, 5, n - 1]] = 5.0
        cases[5] = cases[5].round()  # many ties
        for x in cases:
            for table, v in ((ids, vocab), (None, n), (None, n - 3)):
                if table is None and v >= n + 1:
                    continue
                assert cpu_kernels.chain_argmax(x, table, v) == spread_argmax(x, table, v)
    # the maximum only at ids the vocabulary drops: the largest logit among the counted ones
    x = torch.tensor([1.0, 7.0, 3.0, 7.0, 2.0, 0.0, 0.0, 0.0, 0.0, 7.0])
    ids = torch.tensor([4, 900, 2, 901, 0, 5, 6, 7, 8, 902])
    assert cpu_kernels.chain_argmax(x, ids, 600) == 2 == spread_argmax(x, ids, 600)
    assert cpu_kernels.chain_argmax(torch.tensor([3.0, 3.0]), torch.tensor([700, 800]), 600) == 0  # none counts
