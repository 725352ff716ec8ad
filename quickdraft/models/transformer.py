"""A compact decoder-only transformer covering the Llama family and GPT-2.

One implementation, gpt-fast style: fused q/k/v and gate/up projections, a preallocated
KV cache, explicit positions and cache slots, and hooks that later methods need
(layer ranges for early exit, skipped sub-layers for layer skip, hidden states for heads,
arbitrary attention masks for token trees, per-row lengths for batches).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import cpu_kernels
from .config import ModelConfig
from .draft_vocab import spread_logits
from .kv_cache import KVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        # 0-dim tensors, not Python numbers: an in-place op on a wrapped scalar costs 3 more
        # aten calls (measured 13.5 vs 7.9 us for the two ops); same float32 values.
        self._dim, self._eps = torch.tensor(float(dim), device="cpu"), torch.tensor(eps, device="cpu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm's arithmetic, bit for bit (mean is sum then divide; pow(2) is x * x),
        # in a third of its aten calls: on the CPU it is a composite of ~24 ops that wrap
        # and cast scalars, and a decode step runs 2 * n_layers + 1 norms.
        if cpu_kernels.fused_layers(x):  # one call instead of six (cpu_kernels)
            return cpu_kernels.rms_norm(x, self.weight, self.eps)
        if x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled():
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        scale = (x * x).sum(-1, keepdim=True).div_(self._dim).add_(self._eps).rsqrt_()
        return (x * scale).mul_(self.weight)


def make_norm(config: ModelConfig) -> nn.Module:
    if config.family == "gpt2":
        return nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
    return RMSNorm(config.hidden_size, config.norm_eps)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies, with Llama 3 frequency-dependent scaling when configured."""
    dim = config.head_dim
    # On the CPU whatever the default device: a model built on the meta device (loading)
    # would otherwise run this through torch's reference kernels, which import torch._dynamo
    # (2 s); the table is a plain attribute, on the CPU like the tables built from it.
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the Hugging Face Llama layout). x: [B, H, T, D], cos/signed_sin:
    [B, 1, T, D], the sine's first half negated (``Transformer._rope``'s table).

    Rotate-half multiplies ``cat(-x2, x1)`` by sin; with the sign folded into the table the
    rotation is the halves swapped: the same products bit for bit (negation is exact),
    without a negated copy per layer. (``x.roll(half, -1)`` swaps them too, but costs ~40x
    this cat on these small non-contiguous views.)"""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


def additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean attention mask (True = attend) as the additive one (0 / -inf) that
    ``F.scaled_dot_product_attention`` turns it into: converted once per pass instead of
    once per layer (the same values, so the same attention, bit for bit)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask.logical_not(), float("-inf"))


# Attention kernels for eager passes on CUDA: every backend but cuDNN's. cuDNN attention
# builds an execution plan for each new key length, and a decode step's key length grows
# by one each step: on the first GPU runs (H200 and H100, torch 2.11) that plan cost
# ~50 ms a step whatever the model's size, where the whole warmed 1B step took ~6 ms
# (docs/gpu.md, "Results"). A captured step has fixed shapes, so it keeps torch's choice.
EAGER_CUDA_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_kernels(device: torch.device) -> contextlib.AbstractContextManager:
    """The attention backends a pass on ``device`` may use (see ``EAGER_CUDA_ATTENTION``)."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return sdpa_kernel(EAGER_CUDA_ATTENTION)


@dataclass(frozen=True)
class RaggedRow:
    """One row of a ragged pass (``Transformer.forward(ragged=...)``). A ragged pass feeds
    the rows' tokens packed one after another in a single sequence (batch 1, no padding
    between rows): the row's ``tokens`` new tokens sit at ``offset ..`` of it, live in
    KV-cache row ``cache_row`` and go to its slots ``start, start + 1, ...`` after the
    ``start`` tokens it holds."""

    cache_row: int
    start: int
    tokens: int
    offset: int = 0


# Devices whose ragged passes attend in one padded call (PaddedRows) instead of row by row:
# on a GPU the row loop launches ~6 kernels per row and layer, which at 256 rows (the
# self-distillation writer) is ~46k launches a decode step. The CPU keeps the row loop
# (its fused kernel is already one call per row, and batch invariance holds there bit for
# bit; docs/batching.md): padding changes a row's rounding with the other rows' lengths.
PADDED_RAGGED_DEVICES = ("cuda",)


@dataclass(frozen=True)
class PaddedRows:
    """A ragged pass's rows laid out for one attention call: row ``i`` of the padded batch
    is cache row ``cache_rows[i]``; its token ``t`` sits at ``packed[i, t]`` of the packed
    sequence; ``mask`` (additive, ``[R, 1, T, kv_len]``) lets each token see its row's cache
    and its row's earlier tokens, nothing else (a padded query sees slot 0 only, and is
    dropped). The real tokens, in row order: their place in the packed sequence
    (``token_packed``), their cache row and slot (``token_rows``, ``token_slots``) and their
    place in the flattened ``[R * T]`` padded layout (``token_flat``). These are index
    lists made on the host once a pass, because selecting with a boolean mask on the device
    reads the selection's size back to the host: a synchronisation per selection, four a
    layer, which left the GPU idle between a decode step's kernels (session 49's H200:
    ~460 tokens/s from `train data` at 128 rows, no faster than the CPU)."""

    cache_rows: torch.Tensor
    packed: torch.Tensor
    mask: torch.Tensor
    token_packed: torch.Tensor
    token_rows: torch.Tensor
    token_slots: torch.Tensor
    token_flat: torch.Tensor

    @staticmethod
    def build(ragged: Sequence[RaggedRow], kv_len: int, dtype: torch.dtype, device: torch.device) -> PaddedRows:
        width = max(r.tokens for r in ragged)
        t = torch.arange(width)
        tokens = torch.tensor([r.tokens for r in ragged])[:, None]
        starts = torch.tensor([r.start for r in ragged])[:, None]
        cache_rows = torch.tensor([r.cache_row for r in ragged])
        valid = t < tokens
        packed = torch.tensor([r.offset for r in ragged])[:, None] + torch.minimum(t, tokens - 1)
        slots = starts + t
        seen = torch.arange(kv_len) <= torch.where(valid, slots, 0)[:, :, None]
        mask = additive_mask(seen[:, None], dtype)
        per_token = (packed[valid], cache_rows[:, None].expand_as(packed)[valid], slots[valid],
                     valid.flatten().nonzero().flatten())
        return PaddedRows(*(v.to(device, non_blocking=True) for v in (cache_rows, packed, mask, *per_token)))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int,
               gqa: bool) -> torch.Tensor:
        """Write the rows' keys and values (``[1, H, P, D]`` packed) to their cache rows and
        return the attention output in the packed layout (padding after the rows: 0)."""
        cache.k[layer, self.token_rows, :, self.token_slots] = k[0][:, self.token_packed].transpose(0, 1)
        cache.v[layer, self.token_rows, :, self.token_slots] = v[0][:, self.token_packed].transpose(0, 1)
        kv_len = self.mask.shape[-1]
        keys = cache.widen(cache.k[layer, self.cache_rows, :, :kv_len])
        values = cache.widen(cache.v[layer, self.cache_rows, :, :kv_len])
        queries = q[0][:, self.packed].transpose(0, 1)  # [R, H, T, D]
        att = F.scaled_dot_product_attention(queries, keys, values, attn_mask=self.mask, enable_gqa=gqa)
        rows, heads, width, head_dim = att.shape
        out = q.new_zeros(q.shape)
        out[0][:, self.token_packed] = att.transpose(0, 1).reshape(heads, rows * width, head_dim)[:, self.token_flat]
        return out


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        qkv_out = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
        self.wqkv = nn.Linear(config.hidden_size, qkv_out, bias=config.qkv_bias)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.hidden_size, bias=config.o_bias)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        cache: KVCache,
        layer: int,
        rows: torch.Tensor,
        slots: torch.Tensor,
        mask: torch.Tensor | None,
        kv_len: int,
        ragged: Sequence[tuple[RaggedRow, torch.Tensor | None]] = (),
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        if cpu_kernels.fused_layers(x) and isinstance(cache.k, torch.Tensor) and not isinstance(ragged, PaddedRows):
            return self._fused(x, rope, cache, layer, slots, mask, kv_len, ragged)
        qk, v = self.wqkv(x).split([q_size + kv_size, kv_size], dim=-1)
        # Queries and keys get the same rotation: one RoPE over both halves the op count.
        qk = qk.view(bsz, seqlen, self.n_heads + self.n_kv_heads, self.head_dim).transpose(1, 2)
        if rope is not None:
            qk = apply_rope(qk, *rope)
        q, k = qk.split([self.n_heads, self.n_kv_heads], dim=1)
        v = v.view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        gqa = self.n_heads != self.n_kv_heads
        if isinstance(ragged, PaddedRows):
            out = ragged.attend(q, k, v, cache, layer, gqa)
        elif ragged:  # packed rows (batch 1); tokens after the last row are padding: output 0
            out = q.new_zeros(bsz, self.n_heads, seqlen, self.head_dim)
            for row, row_mask in ragged:
                # Each row writes its own run of its cache row and attends over exactly its
                # own tokens and cache, in the same contiguous layout whatever else is in
                # the pass: its arithmetic (and so its output, bit for bit) is its own.
                a, b, end, r = row.offset, row.offset + row.tokens, row.start + row.tokens, row.cache_row
                cache.k[layer, r, :, row.start : end] = k[0, :, a:b]
                cache.v[layer, r, :, row.start : end] = v[0, :, a:b]
                out[0, :, a:b] = F.scaled_dot_product_attention(
                    q[:, :, a:b].contiguous(), cache.widen(cache.k[layer, r : r + 1, :, :end]),
                    cache.widen(cache.v[layer, r : r + 1, :, :end]), attn_mask=row_mask, enable_gqa=gqa,
                )[0]
        else:
            cache.write(layer, rows, slots, k, v)
            keys, values = cache.layer(layer, kv_len)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, q_size))

    def _fused(self, x: torch.Tensor, rope, cache: KVCache, layer: int, slots: torch.Tensor | int,
               mask: torch.Tensor | None, kv_len: int, ragged: Sequence[tuple[RaggedRow, torch.Tensor | None]]
               ) -> torch.Tensor:
        """``forward`` on the CPU in float32 inference: RoPE, the cache write and attention of
        each row in one call (``cpu_kernels.attend``; the same semantics as the PyTorch path)."""
        bsz, seqlen, _ = x.shape
        qkv = self.wqkv(x)
        out = x.new_zeros(bsz, seqlen, self.n_heads * self.head_dim) if ragged else \
            x.new_empty(bsz, seqlen, self.n_heads * self.head_dim)

        def part(t: torch.Tensor | None, b: int, a: int, z: int) -> torch.Tensor | None:
            """Row ``b``'s tokens ``a:z`` of a ``[B or 1, ..., T, X]`` tensor (itself when it is all of it)."""
            if t is None or (t.shape[0] == 1 and a == 0 and z == t.shape[-2]):
                return t
            return t[b if t.shape[0] > 1 else 0].flatten(0, -2)[a:z]

        rows = [(row.cache_row, row.offset, row.offset + row.tokens, row.start, row.start + row.tokens, row_mask)
                for row, row_mask in ragged] if ragged else \
            [(b, 0, seqlen, slots if isinstance(slots, int) else slots[b], kv_len, part(mask, b, 0, seqlen))
             for b in range(bsz)]
        for r, a, z, row_slots, row_kv_len, row_mask in rows:
            b = 0 if ragged else r  # ragged rows are packed in batch row 0
            row_rope = None if rope is None else (part(rope[0], b, a, z), part(rope[1], b, a, z))
            cpu_kernels.attend(part(qkv, b, a, z), row_rope, cache.k, cache.v, layer, r, row_slots, row_kv_len,
                               row_mask, part(out, b, a, z), self.n_heads)
        return self.wo(out)


class MLP(nn.Module):
    """Gated SiLU MLP (Llama) or plain GELU MLP (GPT-2); gate and up are one fused matmul."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gated = config.family == "llama"
        width = config.intermediate_size
        self.w_in = nn.Linear(config.hidden_size, 2 * width if self.gated else width, bias=config.mlp_bias)
        self.w_out = nn.Linear(width, config.hidden_size, bias=config.mlp_bias)
        act = config.activation
        if act in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
            self.act = nn.GELU(approximate="tanh")
        elif act == "gelu":
            self.act = nn.GELU()
        elif act in ("silu", "swish"):
            self.act = nn.SiLU()
        else:
            raise ValueError(f"activation {act!r} is not supported by the native runtime")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w_in(x)
        if self.gated and isinstance(self.act, nn.SiLU) and cpu_kernels.fused_layers(h):
            return self.w_out(cpu_kernels.silu_mul(h))
        if self.gated:
            width = h.shape[-1] // 2
            gate, up = h[..., :width], h[..., width:]  # two slices: chunk makes 8 aten calls
            return self.w_out(self.act(gate) * up)
        return self.w_out(self.act(h))


#: Block -> (its four linears, their ``cpu_kernels.LinearSpec``s or None). The specs hold
#: raw pointers into those linears' tensors, so the linears are kept alive beside them; kept
#: outside the module so that copying or saving a model never copies pointers into another's
#: weights.
_BLOCK_KERNELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


#: Transformer -> {(start, stop): (the blocks' linears, their cpu_kernels.BlockStack or None)},
#: outside the module for the reason _BLOCK_KERNELS is.
_STACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = make_norm(config)
        self.attn = Attention(config)
        self.mlp_norm = make_norm(config)
        self.mlp = MLP(config)

    def linears(self) -> tuple[nn.Module, ...]:
        """q/k/v, output, gate/up and down, read from the module dicts (a step asks for them
        for every layer; ``nn.Module.__getattr__`` would cost ~5 us a layer)."""
        attn, mlp = self._modules["attn"]._modules, self._modules["mlp"]._modules
        return attn["wqkv"], attn["wo"], mlp["w_in"], mlp["w_out"]

    def kernel_specs(self) -> tuple | None:
        """The four linears as ``cpu_kernels.block`` takes them, when every one runs on our
        kernels and the block is a Llama one (RMSNorm, gated SiLU); else None. Kept with the
        layers they point into (``_BLOCK_KERNELS``), rebuilt if a layer is swapped."""
        linears = self.linears()
        known = _BLOCK_KERNELS.get(self)
        if known is not None and all(a is b for a, b in zip(known[0], linears)):
            return known[1]
        specs = None
        if (isinstance(self.attn_norm, RMSNorm) and isinstance(self.mlp_norm, RMSNorm) and self.mlp.gated
                and isinstance(self.mlp.act, nn.SiLU) and all(hasattr(layer, "kernel_spec") for layer in linears)):
            specs = tuple(layer.kernel_spec() for layer in linears)
            specs = specs if all(spec is not None for spec in specs) else None
        _BLOCK_KERNELS[self] = (linears, specs)
        return specs

    def forward(self, x: torch.Tensor, rope, cache: KVCache, layer: int, rows: torch.Tensor, slots: torch.Tensor,
                mask: torch.Tensor | None, kv_len: int, attn: bool = True, mlp: bool = True,
                ragged: Sequence = ()) -> torch.Tensor:
        """One pre-norm residual block; its keys and values go to ``cache`` layer ``layer``.
        ``attn`` / ``mlp`` False skip that sub-layer (identity on the residual stream)."""
        if (attn and mlp and not ragged and x.shape[0] == 1 and cpu_kernels.fused_layers(x)
                and isinstance(cache.k, torch.Tensor)):
            specs = self.kernel_specs()
            if specs is not None:  # the same kernels as below, in one call (cpu_kernels.block)
                return cpu_kernels.block(
                    x, (self.attn_norm.weight, self.mlp_norm.weight, self.attn_norm.eps), specs, self.attn.n_heads,
                    rope, cache.k, cache.v, layer, slots if isinstance(slots, int) else slots[0], kv_len,
                    None if mask is None else mask[0, 0])
        if attn:
            x = x + self.attn(self.attn_norm(x), rope, cache, layer, rows, slots, mask, kv_len, ragged)
        if mlp:
            x = x + self.mlp(self.mlp_norm(x))
        return x


@dataclass
class ForwardOutput:
    """What one forward pass returns.

    ``hidden`` is the residual stream after the last layer run (before the final norm);
    ``hidden_states[i]`` follows the Hugging Face numbering: 0 is the embedding output and
    ``i`` the output of block ``i - 1``.
    """

    logits: torch.Tensor | None
    hidden: torch.Tensor
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)


class Transformer(nn.Module):
    """Decoder-only transformer with an external KV cache.

    ``forward`` appends new tokens at explicit ``positions`` (what RoPE / learned position
    embeddings see) and cache ``slots`` (where their keys and values are stored; equal to
    the positions except in token trees). The default attention mask lets each query see
    every slot up to its own, which is causal attention for contiguous writes and keeps
    rows of different lengths in a batch apart.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.pos_embed = (
            nn.Embedding(config.max_position_embeddings, config.hidden_size)
            if config.family == "gpt2"
            else None
        )
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = make_norm(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self._inv_freq = rope_inv_freq(config) if config.family == "llama" else None
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.head_ids: torch.Tensor | None = None  # restrict_head's vocabulary
        self.sub_head: nn.Linear | None = None
        # How the KV cache stores keys and values (None: in the weights' dtype; float16:
        # --kv-cache float16, attention still in the compute dtype).
        self.kv_dtype: torch.dtype | None = None

    def restrict_head(self, ids: torch.Tensor) -> None:
        """Score only the tokens ``ids`` from now on; every other logit is ``-inf``.

        A draft model's frequency-ranked vocabulary (FR-Spec, Zhao et al. 2025): on a small
        draft the LM head is a large share of a decode step (most of it for large
        vocabularies), and the tokens a draft gets right are the frequent ones, so a head
        over the most frequent eighth of the vocabulary drafts nearly as well for less
        (the embedded draft: 237 instead of 307 us a step, agreement 77.4 instead of
        80.0%). Lossless for
        speculative decoding: the draft's distribution is simply zero elsewhere. Call it
        before wrapping the model in ``NativeLM`` (its decode kernels then pack this head).
        """
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        weight = self.head_rows(ids)
        self.sub_head = nn.Linear(self.config.hidden_size, ids.numel(), bias=False,
                                  device=weight.device, dtype=weight.dtype)
        self.sub_head.weight.data.copy_(weight)
        self.sub_head.requires_grad_(False)
        self.head_ids = ids.to(weight.device)

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The LM head's rows for the distinct token ids ``ids`` (a copy; a quantized head,
        ``quant_linear.quantize_head``, gives the weights it multiplies by)."""
        if ids.numel() == 0 or ids.min() < 0 or ids.max() >= self.config.vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError(f"a restricted head needs distinct token ids in [0, {self.config.vocab_size})")
        weight = self.lm_head.weight.detach() if isinstance(self.lm_head, nn.Linear) else self.lm_head.dequantized()
        return weight[ids.to(weight.device)]

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> KVCache:
        """A zeroed KV cache for ``batch_size`` rows of up to ``max_len`` tokens, storing
        keys and values in :attr:`kv_dtype` (None: the weights' dtype)."""
        weight = self.embed.weight
        length = max_len or self.config.max_position_embeddings
        return KVCache(self.config, batch_size, length, dtype=weight.dtype, device=weight.device,
                       store_dtype=self.kv_dtype)

    def _rope(self, positions: torch.Tensor | int, length: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / signed sin (:func:`apply_rope`) for ``positions`` (``[B, T]``; an int ``p``: ``p .. p + length - 1`` in
        every row), shaped ``[B or 1, 1, T, head_dim]``."""
        if isinstance(positions, int):
            needed = positions + length
        elif positions.device.type == "cpu" and not torch.compiler.is_compiling():
            needed = int(positions.max()) + 1
        else:  # reading the largest position would wait for the GPU (or break a compiled graph):
            needed = self.config.max_position_embeddings  # cover every position once
        # A table built under inference mode (decoding) cannot enter a graph autograd
        # records: a model trained after it decoded (a drafter probed while it trains)
        # builds its own once.
        # (Not while torch.compile traces: is_inference() breaks the graph, and a captured step
        # only decodes.)
        stale = (not torch.compiler.is_compiling() and self._rope_cache is not None
                 and self._rope_cache[0].is_inference() and not torch.is_inference_mode_enabled())
        if self._rope_cache is None or stale or self._rope_cache[0].shape[0] < needed:
            size = max(needed, 2 * (self._rope_cache[0].shape[0] if self._rope_cache else 1024))
            freqs = torch.outer(torch.arange(size, dtype=torch.float64), self._inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            signed_sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)  # see apply_rope
            dtype, device = self.embed.weight.dtype, self.embed.weight.device
            self._rope_cache = (emb.cos().to(dtype=dtype, device=device), signed_sin.to(dtype=dtype, device=device))
        cos, sin = self._rope_cache
        if isinstance(positions, int):  # a slice: no gather, no host sync
            return cos[None, None, positions : positions + length], sin[None, None, positions : positions + length]
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    def embed_tokens(self, tokens: torch.Tensor, positions: torch.Tensor | int) -> torch.Tensor:
        x = self.embed(tokens)
        if self.pos_embed is not None:
            if isinstance(positions, int):
                positions = torch.arange(positions, positions + tokens.shape[-1], device=tokens.device)[None]
            x = x + self.pos_embed(positions)
        return x

    def attention_inputs(
        self, positions: torch.Tensor | int, cache: KVCache, slots: torch.Tensor | int | None = None,
        mask: torch.Tensor | None = None, shape: tuple[int, int] | None = None, kernel_causal: bool = False,
    ) -> tuple:
        """What every block of a pass shares: ``(rope, rows, mask [B, 1, T, S] or None,
        kv_len)`` for queries at ``positions`` written to ``slots`` (see :meth:`forward`).
        ``shape`` is the pass's ``(B, T)``, needed when the positions are an int.
        ``kernel_causal``: the pass runs on our kernels (``cpu_kernels.blocks``), whose
        attention without a mask is causal: a contiguous pass builds none."""
        if slots is None:
            slots = positions
        if isinstance(positions, int) and shape is None:
            raise ValueError("attention_inputs needs the pass's (batch, tokens) shape with int positions")
        bsz, seqlen = positions.shape if shape is None else shape
        if mask is not None:
            kv_len = mask.shape[-1]
            mask = mask.unsqueeze(1) if mask.dim() == 3 else mask
        elif isinstance(slots, int):
            kv_len = slots + seqlen
            if seqlen > 1 and not kernel_causal:  # causal after the cached prefix, alike in every row: additive at once
                # (-inf above the diagonal; half the time of a boolean mask then converted)
                mask = torch.full((seqlen, kv_len), float("-inf"), dtype=cache.dtype, device=cache.k.device)
                mask = mask.triu_(slots + 1)[None, None]
        else:
            kv_len = int(slots.max()) + 1
            if seqlen > 1 or bsz > 1:
                visible = torch.arange(kv_len, device=slots.device)
                mask = (visible[None, None, :] <= slots[:, :, None]).unsqueeze(1)
        if kv_len > cache.max_len:
            raise ValueError(f"sequence of {kv_len} tokens exceeds the KV cache size {cache.max_len}")
        mask = additive_mask(mask, cache.dtype)
        rows = None if isinstance(slots, int) else torch.arange(bsz, device=slots.device)[:, None]
        rope = self._rope(positions, seqlen) if self._inv_freq is not None else None
        return rope, rows, mask, kv_len

    def ragged_inputs(self, positions: torch.Tensor, cache: KVCache, ragged: Sequence[RaggedRow]) -> tuple:
        """What every block of a ragged pass shares (see :meth:`forward`'s ``ragged``):
        ``(rope, [(row, its causal mask or None)], kv_len)``, or on the devices of
        ``PADDED_RAGGED_DEVICES`` ``(rope, PaddedRows, kv_len)``: one attention call for all rows."""
        kv_len = max(r.start + r.tokens for r in ragged)
        if kv_len > cache.max_len:
            raise ValueError(f"sequence of {kv_len} tokens exceeds the KV cache size {cache.max_len}")
        rope = self._rope(positions) if self._inv_freq is not None else None
        if isinstance(cache.k, torch.Tensor) and cache.k.device.type in PADDED_RAGGED_DEVICES:
            return rope, PaddedRows.build(ragged, kv_len, cache.dtype, cache.k.device), kv_len
        row_masks = []
        for r in ragged:
            causal = None
            if r.tokens > 1:
                causal = torch.ones(r.tokens, r.start + r.tokens, dtype=torch.bool, device=positions.device)
                causal = additive_mask(causal.tril(diagonal=r.start), cache.dtype)
            row_masks.append((r, causal))
        return rope, row_masks, kv_len

    def block_stack(self, start: int, stop: int) -> cpu_kernels.BlockStack | None:
        """Layers ``[start, stop)`` as one ``cpu_kernels.BlockStack`` when every one of them
        runs in one C call (``Block.kernel_specs``) with the same norm eps; else None. Kept
        beside the model (``_STACKS``) and rebuilt when a block's linears are swapped."""
        blocks = [self.layers._modules[str(i)] for i in range(start, stop)]
        # Exactly Blocks: a substitute or subclass (tests swap in their own) runs its own forward.
        if any(type(block) is not Block for block in blocks):
            return None
        linears = [linear for block in blocks for linear in block.linears()]
        known = _STACKS.setdefault(self, {}).get((start, stop))
        if known is not None and len(known[0]) == len(linears) and all(a is b for a, b in zip(known[0], linears)):
            return known[1]
        specs = []
        for block in blocks:
            block_specs = block.kernel_specs()
            if block_specs is None:
                _STACKS[self][(start, stop)] = (linears, None)
                return None
            specs.append(block_specs)
        norms = [(self.layers[i].attn_norm, self.layers[i].mlp_norm) for i in range(start, stop)]
        eps = {norm.eps for pair in norms for norm in pair}
        stack = None
        if len(eps) == 1:
            stack = cpu_kernels.BlockStack([(a.weight, m.weight) for a, m in norms], eps.pop(), specs)
        _STACKS[self][(start, stop)] = (linears, stack)
        return stack

    def greedy_chain(self, first: int | torch.Tensor | None, n: int, start: int, cache: KVCache,
                     vocab: int, feed: torch.Tensor | None = None, min_confidence: float = 0.0,
                     stop_ids: Sequence[int] = ()) -> list[int] | None:
        """``[first, t1, .., tn]``: ``first`` and ``n`` greedy tokens after it, fed at
        position and cache slot ``start`` on, in one C call (``cpu_kernels.greedy_chain``):
        what ``n`` one-token forwards (row 0) and ``argmax`` over the first ``vocab``
        logits give, bit for bit, without the Python between them. ``first`` may be the
        logits it is the argmax of (read only if the chain runs). With ``feed`` (token ids
        at positions ``start - len(feed) ..``, ``first`` None) the call feeds them first, as
        a forward over them would, and ``first`` is the argmax of its last logits.
        ``min_confidence`` (with ``feed``): the chain ends after the first token whose
        softmax top-1 probability is below it (``cpu_kernels.greedy_chain``), as it does at
        the first token in ``stop_ids``. None where it cannot run (not a Llama model whose
        blocks and head all run on our kernels, or the cache is too short): the caller
        steps in Python."""
        m = 0 if feed is None else feed.numel()
        if (not isinstance(cache.k, torch.Tensor) or start + n > cache.max_len or start < m
                or (feed is None) == (first is None) or (min_confidence > 0 and feed is None)):
            return None
        parts = self.one_call_parts()
        if parts is None:
            return None
        stack, spec = parts
        cos, sin = self._rope(start - m, m + n)
        first = int(first.argmax()) if isinstance(first, torch.Tensor) else first
        return cpu_kernels.greedy_chain(first, n, self.embed.weight, stack, self.layers[0].attn.n_heads,
                                        (cos[0, 0], sin[0, 0]), cache.k, cache.v, start,
                                        (self.norm.weight, self.norm.eps), spec, self.head_ids, vocab, feed,
                                        min_confidence, stop_ids)

    def chain_model(self, cache: KVCache, vocab: int, positions: int) -> tuple[tuple, tuple] | None:
        """This model's greedy chains (:meth:`greedy_chain`'s, over the first ``vocab`` ids,
        positions below ``positions``) as ``cpu_kernels.spec_rounds`` drafts them
        (``cpu_kernels.chain_model``), or None where :meth:`greedy_chain` cannot run."""
        parts = self.one_call_parts() if isinstance(cache.k, torch.Tensor) else None
        if parts is None:
            return None
        cos, sin = self._rope(0, positions)
        return cpu_kernels.chain_model(self.embed.weight, parts[0], self.layers[0].attn.n_heads, cache.k, cache.v,
                                       (self.norm.weight, self.norm.eps), parts[1], self.head_ids, vocab,
                                       (cos[0, 0], sin[0, 0]))

    def one_call_parts(self) -> tuple[cpu_kernels.BlockStack, cpu_kernels.LinearSpec] | None:
        """The block stack and head spec our kernels run the whole model with in one call
        (:meth:`greedy_chain`, :meth:`forward_call`); None where they cannot: not a Llama
        model (RoPE, RMSNorm, no learned positions) whose blocks and head all run on our
        kernels here."""
        weight = self.embed.weight
        if (self.pos_embed is not None or self._inv_freq is None or not isinstance(self.norm, RMSNorm)
                or not cpu_kernels.fused_layers(weight) or not weight.is_contiguous()):
            return None
        head = self.lm_head if self.head_ids is None else self.sub_head
        spec = head.kernel_spec() if hasattr(head, "kernel_spec") else None
        stack = self.block_stack(0, self.config.n_layers)
        return None if spec is None or stack is None else (stack, spec)

    def forward_call(self, cache: KVCache) -> cpu_kernels.ForwardCall | None:
        """This model's causal pass over new tokens of cache row 0 (every layer, the whole
        vocabulary's logits) as one C call, set up for ``cache``: what :meth:`forward` gives
        such a pass, bit for bit. None where it cannot run (:meth:`one_call_parts`, a
        restricted head, a cache our kernels do not take)."""
        parts = None if self.head_ids is not None or not isinstance(cache.k, torch.Tensor) else self.one_call_parts()
        if parts is None or cache.k.dtype not in (torch.float32, torch.float16):
            return None
        stack, spec = parts
        return cpu_kernels.ForwardCall(self.embed.weight, stack, self.layers[0].attn.n_heads, cache.k, cache.v,
                                       (self.norm.weight, self.norm.eps), spec)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: the exit head shared by every layer (over the restricted
        vocabulary after :meth:`restrict_head`, other logits ``-inf``)."""
        x = self.norm(hidden)
        if self.head_ids is None:
            return self.lm_head(x)
        return spread_logits(self.sub_head(x), self.head_ids, self.config.vocab_size)

    def forward(
        self,
        tokens: torch.Tensor | None,
        positions: torch.Tensor | int,
        cache: KVCache,
        *,
        slots: torch.Tensor | int | None = None,
        mask: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
        layers: tuple[int, int] | None = None,
        skip_attn: Collection[int] = (),
        skip_mlp: Collection[int] = (),
        output_hidden_states: Sequence[int] = (),
        logits: str | int = "all",
        ragged: Sequence[RaggedRow] | None = None,
    ) -> ForwardOutput:
        """Run layers ``[a, b)`` (all by default) over ``T`` new tokens per row.

        Args:
            tokens: ``[B, T]`` token ids; ``None`` when resuming from ``hidden``.
            positions: ``[B, T]`` position ids, or an int ``p``: positions ``p .. p + T - 1``
                in every row (contiguous decoding: no gathers, no host syncs).
            cache: the KV cache; new keys/values are written at ``slots``.
            slots: ``[B, T]`` cache slots, or an int ``s``: slots ``s .. s + T - 1`` of cache
                rows ``0 .. B - 1`` (default: ``positions``).
            mask: boolean ``[B or 1, T, S]`` over cache slots ``0..S-1`` (True = attend).
                Default: slot ``s`` is visible to a query in slot ``q`` iff ``s <= q``.
            hidden: ``[B, T, hidden_size]`` residual stream to resume from at layer ``a``.
            layers: the half-open layer range to run.
            skip_attn / skip_mlp: layer indices whose attention / MLP sub-layer is skipped
                (identity on the residual stream; skipped attention writes no KV).
            output_hidden_states: which hidden states to return (HF numbering).
            logits: ``"all"``, ``"last"`` (only the last position of each row), an int ``n``
                (the last ``n`` positions) or ``"none"``. Logits are the final norm + LM head
                applied to the last layer run, so a partial range gives early-exit logits.
            ragged: the rows of a packed pass (the batched engine): ``tokens`` is ``[1, T]``,
                the rows' tokens one after another (:class:`RaggedRow` ``offset``), then
                any padding; each row writes its own cache row and attention runs row by
                row over its own tokens only (causal after its cache; ``slots`` and
                ``mask`` unused; padding writes nothing and its output is 0).
        """
        start, stop = layers if layers is not None else (0, self.config.n_layers)
        if hidden is None:
            if tokens is None:
                raise ValueError("forward needs tokens or a hidden state to resume from")
            if start != 0:
                raise ValueError("starting after layer 0 needs the hidden state to resume from")
            x = self.embed_tokens(tokens, positions)
        else:
            x = hidden
        slots = positions if slots is None else slots
        # The blocks in as few C calls as the states asked for allow (one, or one per
        # stretch between them: EAGLE-3's fused layers): what the loop below does, bit for bit.
        # A ragged pass (the batched engine's) too, its rows attending each on its own.
        stacks = None
        if (x.shape[0] == 1 and not any(start <= i < stop for i in (*skip_attn, *skip_mlp))
                and cpu_kernels.fused_layers(x) and isinstance(cache.k, torch.Tensor)
                and (ragged is None or cache.k.device.type not in PADDED_RAGGED_DEVICES)):  # (not padded rows)
            cuts = sorted({start, stop, *(i for i in output_hidden_states if start < i < stop)})
            stacks = [self.block_stack(a, b) for a, b in zip(cuts, cuts[1:])]
            stacks = stacks if all(stack is not None for stack in stacks) else None
        row_masks: list[tuple[RaggedRow, torch.Tensor | None]] | PaddedRows = []
        if ragged is None:
            rope, rows, mask, kv_len = self.attention_inputs(positions, cache, slots, mask, x.shape[:2],
                                                             kernel_causal=stacks is not None)
        else:
            rope, row_masks, kv_len = self.ragged_inputs(positions, cache, ragged)
            rows = None

        states: dict[int, torch.Tensor] = {}
        if start in output_hidden_states:
            states[start] = x
        if stacks is not None:
            for a, b, stack in zip(cuts, cuts[1:], stacks):
                if ragged is None:
                    x = cpu_kernels.blocks(x, stack, self.layers[a].attn.n_heads, rope, cache.k, cache.v, a,
                                           slots if isinstance(slots, int) else slots[0], kv_len,
                                           None if mask is None else mask[0, 0])
                else:
                    x = cpu_kernels.blocks_ragged(x, stack, self.layers[a].attn.n_heads, rope, cache.k, cache.v, a,
                                                  row_masks)
                if b in output_hidden_states:
                    states[b] = x
        else:
            with attention_kernels(x.device):
                for i in range(start, stop):
                    x = self.layers[i](x, rope, cache, i, rows, slots, mask, kv_len, i not in skip_attn,
                                       i not in skip_mlp, row_masks)
                    if i + 1 in output_hidden_states:
                        states[i + 1] = x
        out = None
        if logits == "all":
            out = self.head(x)
        elif logits != "none":
            out = self.head(x[:, -(1 if logits == "last" else logits) :])
        return ForwardOutput(logits=out, hidden=x, hidden_states=states)
