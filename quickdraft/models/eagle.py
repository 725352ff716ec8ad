"""An EAGLE-style feature drafter (Li et al. 2024; EAGLE-3's training-time test): one
decoder layer that predicts the target's next final hidden state ("feature") from the
current token and the previous feature, read by the target's own final norm and LM head.

Slot ``p`` of the drafter's sequence holds token ``x_p`` with the feature of the token
before it, ``fc([embed(x_p); f_{p-1}])`` (a zero feature for ``p = 0``); its output
``h_p`` stands for ``f_p``, and ``head(h_p)`` predicts ``x_{p+1}``. The target's features
are known for every token it has verified; past them the drafter feeds its own outputs
back (a tree node's feature is its parent's output). Training unrolls exactly that
(:meth:`EagleHead.unrolled`): step ``k`` feeds step ``k - 1``'s outputs back and attends as
a depth ``k - 1`` tree node does, so what is trained is what drafts.

The LM head may score a reduced draft vocabulary (the most frequent tokens of the training
text, FR-Spec / EAGLE-3): its rows, copied from the target's frozen LM head, are stored
with the drafter, since the target's own head may be packed for decoding. Other tokens
get ``-inf`` logits: they are never drafted, which costs acceptance, never exactness.
The layer may be narrower than the target (``layer``: a draft model's shape, e.g. the
embedded draft's 256 wide against the target's 448): it then has its own token embedding,
final norm and LM head rows, and maps the target's features to its width with one linear
(``feature_in``) before ``fc``; what it feeds back is its own output at its width. A step
then reads a draft model's bytes instead of a target layer's, and it can start as that
draft model (``from_draft``). Without a target-width output there is no feature to
regress: it learns from the soft cross-entropy alone (as EAGLE-3 does).

Either width may fuse several of the target's layers (``feature_layers``, EAGLE-3): each
state at unit RMS, side by side, through ``feature_in``. At the target's width the final
state is one of them, and the map starts as its identity (the other layers' columns zero),
so a drafter of the final state alone can be widened without losing what it learned.

Saved as ``config.json`` + ``model.safetensors`` with the target's fingerprint.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from . import cpu_kernels
from .draft_vocab import read_draft_vocab, spread_logits
from .exit_head import target_fingerprint
from .head_files import HeadFiles
from .kv_cache import KVCache
from .loading import CheckpointError
from .transformer import Block, RMSNorm, Transformer, apply_rope, make_norm

EAGLE_KIND = "quickdraft-eagle-head"
#: What ``EagleConfig.layer`` may set: the layer's shape where it is not the target's.
LAYER_FIELDS = ("hidden_size", "n_heads", "n_kv_heads", "intermediate_size")


@dataclass
class EagleConfig:
    """What a saved drafter is, and the target it reads."""

    hidden_size: int
    vocab_size: int
    draft_vocab: int  # tokens its LM head scores (0: the target's whole vocabulary)
    target: str = ""
    target_fingerprint: str = ""
    kind: str = EAGLE_KIND
    layer: dict[str, int] | None = None  # LAYER_FIELDS where the layer is not the target's shape
    #: The target's states it reads (``Transformer.forward``'s numbering), fused through
    #: ``feature_in`` (EAGLE-3); None: the final state alone.
    feature_layers: list[int] | None = None


def check_feature_layers(layers: Sequence[int] | None, n_layers: int, own_width: bool) -> tuple[int, ...]:
    """The target states a drafter reads, checked: ``layers`` (None: the final one,
    ``n_layers``), each a layer's output ``1 .. n_layers``, increasing; several are fused by
    ``feature_in`` (EAGLE-3). A drafter of the target's width that fuses layers reads the
    final one last: its output stands for that state (what it regresses and feeds back)."""
    chosen = (n_layers,) if not layers else tuple(int(i) for i in layers)
    if any(not 1 <= i <= n_layers for i in chosen) or list(chosen) != sorted(set(chosen)):
        raise ValueError(f"feature layers {','.join(map(str, chosen))}: increasing layer numbers from 1 to "
                         f"the target's {n_layers} (its final state), e.g. 2,5,{n_layers}")
    if len(chosen) > 1 and not own_width and chosen[-1] != n_layers:
        raise ValueError(f"feature layers {','.join(map(str, chosen))}: a drafter of the target's width fuses "
                         f"them with the final state, whose place its output takes: end them with {n_layers}")
    return chosen


class EagleHead(nn.Module):
    """``fc`` + one decoder layer, of the target's shape (read by the target's final norm and
    LM head rows) or of its own ``layer`` shape (with its own embedding, norm and rows)."""

    def __init__(self, target: Transformer, vocab_ids: torch.Tensor | None = None,
                 layer: dict[str, int] | None = None, feature_layers: Sequence[int] | None = None) -> None:
        super().__init__()
        tc = target.config
        unknown = set(layer or ()) - set(LAYER_FIELDS)
        if unknown:
            raise ValueError(f"an EAGLE layer's shape sets {', '.join(LAYER_FIELDS)}, not {', '.join(sorted(unknown))}")
        self.layer_config = dataclasses.replace(tc, n_layers=1, **(layer or {}))
        width = self.layer_config.hidden_size
        if self.layer_config.head_dim * self.layer_config.n_heads != width:
            raise ValueError(f"an EAGLE layer {width} wide needs {width // tc.head_dim} heads of the target's "
                             f"{tc.head_dim} (the target's rotary tables), not {self.layer_config.n_heads}")
        self.own_width = width != tc.hidden_size
        self.feature_layers = check_feature_layers(feature_layers, tc.n_layers, self.own_width)
        self.fc = nn.Linear(2 * width, width, bias=False)
        with torch.no_grad():  # the feature passes through at first: the layer learns what changes
            self.fc.weight[:, width:].copy_(torch.eye(width))
        if self.own_width:
            self.embed = nn.Embedding(tc.vocab_size, width)
            self.feature_in = nn.Linear(len(self.feature_layers) * tc.hidden_size, width, bias=False)
            self.norm = make_norm(self.layer_config)
            if vocab_ids is None:  # its rows are its own: all of them stored
                vocab_ids = torch.arange(tc.vocab_size)
        elif self.fused:
            self.feature_in = nn.Linear(len(self.feature_layers) * width, width, bias=False)
            with torch.no_grad():  # the final state passes through at first: it starts as a drafter of it alone
                self.feature_in.weight.zero_()
                self.feature_in.weight[:, -width:].copy_(torch.eye(width))
        self.register_buffer("embed_scale", torch.ones(1))
        self.set_embed_scale(target)
        self.layer = Block(self.layer_config)
        self.vocab_head: nn.Linear | None = None
        if vocab_ids is not None:
            self.register_buffer("vocab_ids", torch.as_tensor(vocab_ids, dtype=torch.long).clone())
            self.vocab_head = nn.Linear(width, self.vocab_ids.numel(), bias=False)
            # The target's LM head rows stay frozen; a narrow layer's own rows are learned.
            self.vocab_head.requires_grad_(self.own_width)
        else:
            self.vocab_ids = None

    @property
    def layer_shape(self) -> dict[str, int] | None:
        """The layer's shape for ``EagleConfig.layer`` (None: the target's)."""
        cfg = self.layer_config
        return {name: getattr(cfg, name) for name in LAYER_FIELDS} if self.own_width else None

    @property
    def fused(self) -> bool:
        """Whether it reads more of the target than its final state (EAGLE-3's fusion)."""
        return len(self.feature_layers) > 1

    @property
    def maps_features(self) -> bool:
        """Whether the target's states pass ``feature_in`` (a narrow or a fused drafter)."""
        return self.own_width or self.fused

    @property
    def feature_size(self) -> int:
        """The width of what ``fc`` reads beside a token: :meth:`from_target`'s output."""
        return self.layer_config.hidden_size

    def set_embed_scale(self, target: Transformer) -> None:
        """Both halves of fc's input at unit scale: a target's final states are large (the
        embedded target's: RMS ~16) and its embeddings small (RMS ~0.04); unscaled, the
        token would be lost in the feature and take thousands of steps to surface."""
        weight = self.token_embedding(target).weight.detach().float()
        self.embed_scale.fill_(float(1 / weight.pow(2).mean().sqrt().clamp_min(1e-6)))

    def token_embedding(self, target: Transformer) -> nn.Embedding:
        return self.embed if self.own_width else target.embed

    def final_norm(self, target: Transformer) -> nn.Module:
        return self.norm if self.own_width else target.norm

    def from_target(self, features: torch.Tensor) -> torch.Tensor:
        """The target's states ``[..., L * H]`` (its :attr:`feature_layers`, side by side) as
        this drafter reads them beside a token: the final state itself at the target's
        width, else mapped to the layer's width or fused (``feature_in``, each state at
        unit RMS first, as ``fc`` sees both)."""
        if not self.maps_features:
            return features
        if (torch.is_grad_enabled() or features.device.type != "cpu" or features.dtype != torch.float32
                or cpu_kernels.library() is None):
            chunks = len(self.feature_layers)
            return self.feature_in(unit_rms(features.unflatten(-1, (chunks, -1))).flatten(-2))
        # Decoding maps each round's accepted states: one C call where unit_rms's five
        # PyTorch ops took ~115 us a round right after a verify pass (~10 us warm), ~1.5%
        # of an embedded round. It rounds within an ulp of unit_rms (what training used):
        # a drafter's rounding changes what it proposes, never what the target accepts.
        states = features.reshape(-1, features.shape[-1] // len(self.feature_layers))
        return self.feature_in(cpu_kernels.rms_norm(states, None, UNIT_RMS_EPS).view(features.shape))

    def copy_vocab_rows(self, target: Transformer) -> None:
        """Fill the reduced head with the target's LM head rows (an unpacked target); a
        narrow layer's rows are its own (``from_draft`` or trained)."""
        if self.vocab_head is not None and not self.own_width:
            with torch.no_grad():
                self.vocab_head.weight.copy_(target.lm_head.weight[self.vocab_ids])

    def from_draft(self, draft: Transformer, target: Transformer) -> None:
        """Start as ``draft`` (a one-layer Llama draft model of this layer's shape, sharing
        the target's vocabulary): its embedding, layer, final norm and LM head rows, and an
        ``fc`` that passes its embedding through and ignores the feature, so that before any
        training this drafter proposes what the draft model does. Training then learns what
        the target's features add."""
        dc, lc = draft.config, self.layer_config
        same = ("vocab_size", "head_dim", "rope_theta", "rope_scaling", "family", *LAYER_FIELDS)  # lc has the target's rotary
        if not self.own_width or dc.n_layers != 1 or any(getattr(dc, name) != getattr(lc, name) for name in same):
            raise ValueError("an EAGLE drafter starts from a one-layer draft model of its layer's shape, with the "
                             f"target's vocabulary and rotary positions; this draft has {dc.n_layers} layers, width "
                             f"{dc.hidden_size}, vocabulary {dc.vocab_size}, heads of {dc.head_dim}, "
                             f"rope theta {dc.rope_theta:g}")
        with torch.no_grad():
            self.embed.weight.copy_(draft.embed.weight)
            self.layer.load_state_dict(draft.layers[0].state_dict())
            self.norm.load_state_dict(draft.norm.state_dict())
            self.vocab_head.weight.copy_(draft.lm_head.weight[self.vocab_ids])
            self.set_embed_scale(target)
            width = self.feature_size
            self.fc.weight.zero_()
            self.fc.weight[:, :width].copy_(torch.eye(width) / self.embed_scale)

    @property
    def draft_vocab(self) -> int:
        return 0 if self.vocab_ids is None else self.vocab_ids.numel()

    def restrict_vocab(self, ids: torch.Tensor) -> None:
        """Keep the reduced head's rows for the tokens in ``ids`` only (``--draft-vocab``: the
        most frequent of them, ``draft_vocab.json``), in their stored order, so the first
        maximum among them is the same token as before. A cheaper head; only what the
        drafter proposes can change, never what the target accepts."""
        if self.vocab_head is None:
            raise ValueError("--draft-vocab: this EAGLE drafter scores the target's whole vocabulary through "
                             "its LM head; it has no rows of its own to choose from")
        keep = torch.isin(self.vocab_ids, torch.as_tensor(ids, device=self.vocab_ids.device)).nonzero()[:, 0]
        if keep.numel() == 0:
            raise ValueError("--draft-vocab: none of the given tokens is in this EAGLE drafter's head")
        head = nn.Linear(self.vocab_head.in_features, keep.numel(), bias=False,
                         device=keep.device, dtype=self.vocab_head.weight.dtype)
        head.weight.data.copy_(self.vocab_head.weight.detach()[keep])
        self.vocab_head = head.requires_grad_(False)
        self.vocab_ids = self.vocab_ids[keep]

    def inputs(self, tokens: torch.Tensor, features: torch.Tensor, target: Transformer) -> torch.Tensor:
        """The layer's input ``fc([embed(tokens); features])``, each half at unit RMS."""
        embedded = self.token_embedding(target)(tokens) * self.embed_scale
        if cpu_kernels.fused_layers(features):  # as qd_eagle_chain scales it: the same fc input, bit for bit
            unit = cpu_kernels.rms_norm(features, None, UNIT_RMS_EPS)
        else:
            unit = unit_rms(features)
        return self.fc(torch.cat([embedded, unit], dim=-1))

    def sub_logits(self, hidden: torch.Tensor, target: Transformer) -> torch.Tensor:
        """Logits over the draft vocabulary (the whole one without a reduced head)."""
        if self.vocab_head is None:
            return target.head(hidden)
        return self.vocab_head(self.final_norm(target)(hidden))

    def best_token(self, hidden: torch.Tensor, target: Transformer) -> tuple[int, float]:
        """The drafter's argmax token for one output ``[1, H]`` (the first maximum over the
        draft vocabulary, no full-vocabulary scores filled in) and its softmax probability
        there (what a ``--draft-stop`` confidence floor weighs)."""
        scores = self.sub_logits(hidden, target)[0]
        index = int(scores.argmax())
        confidence = float(scores.float().softmax(-1)[index])
        return (index if self.vocab_ids is None else int(self.vocab_ids[index])), confidence

    def greedy_chain(self, feed_tokens: torch.Tensor, feed_features: torch.Tensor, n: int, start: int,
                     cache: KVCache, target: Transformer, slot: int | None = None, raw: bool = False,
                     min_confidence: float = 0.0, call: cpu_kernels.EagleChain | None = None) -> list[int] | None:
        """Feed, then ``n`` greedy draft tokens, in one C call (``cpu_kernels.EagleChain``).

        The feed: ``feed_tokens`` ``[m]`` (m >= 1), each with the target's feature of the
        token before it through :meth:`from_target` (``feed_features`` ``[m, feature_size]``;
        ``raw``: the target's own states ``[m, L * H]``, mapped in the same call), at positions
        ``start - m .. start - 1`` and cache slots ``slot - m ..`` (:meth:`extend`'s causal
        pass). Then :meth:`best_token` of its last output, and of each level fed the token
        before at positions ``start``, ``start + 1``, ... and slots ``slot``, ``slot + 1``,
        ... (default: the positions): what :meth:`extend` and :meth:`best_token` compute, up
        to float rounding; ``min_confidence`` > 0 ends the chain after the first token whose
        top-1 probability over the draft vocabulary is below it. None, with nothing written,
        where it cannot run (float32 CPU inference with a reduced head, our kernels running
        every linear, a Llama target, room in the cache): the caller feeds and steps in
        Python. ``call``: :meth:`chain_call`'s for this target and cache, where the caller
        keeps it (else looked up)."""
        slot, m = start if slot is None else slot, feed_tokens.numel()
        if m < 1 or slot < m or slot + n - 1 > cache.max_len or not cpu_kernels.fused_layers(feed_features):
            return None
        call = call if call is not None else self.chain_call(target, cache)
        if call is None or (raw and self.maps_features and not call.maps):
            return None
        cos, sin = target._rope(start - m, m + n - 1)  # [1, 1, m + n - 1, D] slices of the table: contiguous
        return call(feed_tokens, feed_features, n, (cos, sin), slot, min_confidence, raw and self.maps_features)

    def chain_call(self, target: Transformer, cache: KVCache) -> cpu_kernels.EagleChain | None:
        """The chain call (``cpu_kernels.EagleChain``) for this target and cache, or None
        where it cannot run (see :meth:`greedy_chain`); kept while the linears, the
        embedding, the cache and the target are the same (quantizing swaps linears, moving
        a model replaces its weights, training rescales the embedding)."""
        weight, norm = self.token_embedding(target).weight, self.final_norm(target)
        mapping = getattr(self, "feature_in", None)
        parts = (target, cache.k, self.fc, self.vocab_head, mapping, *self.layer.linears())
        values = (weight.data_ptr(), norm.weight.data_ptr(), float(self.embed_scale))
        known = getattr(self, "_chain", None)
        if (known is not None and known[1] == values and len(known[0]) == len(parts)
                and all(a is b for a, b in zip(known[0], parts))):
            return known[2]
        call = None
        if (self.vocab_head is not None and target.pos_embed is None and target._inv_freq is not None
                and isinstance(norm, RMSNorm) and weight.is_contiguous() and weight.dtype == torch.float32
                and isinstance(cache.k, torch.Tensor)):
            block = self.layer.kernel_specs()
            fc, head, feature_in = (getattr(m, "kernel_spec", lambda: None)() for m in (self.fc, self.vocab_head, mapping))
            norms = (self.layer.attn_norm, self.layer.mlp_norm)
            if block is not None and fc is not None and head is not None and norms[0].eps == norms[1].eps:
                stack = cpu_kernels.BlockStack([(norms[0].weight, norms[1].weight)], norms[0].eps, [block])
                call = cpu_kernels.EagleChain(weight, values[2], fc, stack, self.layer.attn.n_heads,
                                              cache.k, cache.v, (norm.weight, norm.eps), head, self.vocab_ids,
                                              target.config.vocab_size, feature_in, len(self.feature_layers))
        self._chain = (parts, values, call)
        return call

    def logits(self, hidden: torch.Tensor, target: Transformer) -> torch.Tensor:
        """Logits over the target's vocabulary: ``-inf`` outside the draft vocabulary."""
        scores = self.sub_logits(hidden, target)
        return scores if self.vocab_head is None else spread_logits(scores, self.vocab_ids, target.config.vocab_size)

    def new_cache(self, max_len: int, store_dtype: torch.dtype | None = None) -> KVCache:
        """The drafter's KV cache (keys and values stored in ``store_dtype`` if given, as
        ``KVCache`` takes it; attention in the drafter's dtype)."""
        weight = self.layer.attn_norm.weight  # (linears may be packed for decoding: no .weight)
        return KVCache(self.layer_config, 1, max_len, dtype=weight.dtype, device=weight.device,
                       store_dtype=store_dtype)

    def extend(self, tokens: torch.Tensor, features: torch.Tensor, target: Transformer, cache: KVCache,
               positions: torch.Tensor | int, slots: torch.Tensor | int, mask: torch.Tensor | None = None
               ) -> torch.Tensor:
        """Inference: feed ``tokens`` ``[T]`` with ``features`` ``[T, feature_size]`` (the target's
        through :meth:`from_target`, or the drafter's own outputs) at ``positions``,
        keys into ``cache`` at ``slots`` (``mask`` ``[T, S]`` as in ``Transformer.forward``);
        the outputs ``[T, feature_size]``. Tokens and mask may be on the CPU (moved to the features'
        device); tensor positions and slots stay where they are (indices: on the CPU, their
        largest value is read without waiting for a GPU)."""
        tokens = tokens.to(features.device, non_blocking=True)
        if mask is not None:
            mask = mask.to(features.device, non_blocking=True)
        x = self.inputs(tokens[None], features[None], target)
        if not isinstance(positions, int):
            positions, slots = positions[None], slots if isinstance(slots, int) else slots[None]
        rope, rows, mask, kv_len = target.attention_inputs(positions, cache, slots, mask, x.shape[:2])
        return self.layer(x, rope, cache, 0, rows, slots, mask, kv_len)[0]

    def unrolled(self, tokens: torch.Tensor, features: torch.Tensor, target: Transformer, steps: int
                 ) -> list[torch.Tensor]:
        """Training-time test over windows: ``tokens`` ``[B, T]``, the target's ``features``
        ``[B, T, H]``; the outputs ``[B, T, feature_size]`` of steps ``0 .. steps - 1``.

        Step 0 is the drafter on the target's features (slot ``p``: ``x_p``, ``f_{p-1}``).
        Step ``k`` feeds step ``k - 1``'s outputs back (slot ``p``: ``x_p``, ``h^{k-1}_{p-1}``)
        and attends as a tree node at depth ``k - 1`` does when drafting: to step 0's keys
        at slots ``<= p - k`` (what the target verified) and to step ``j``'s key at slot
        ``p - k + j`` for ``j = 1 .. k`` (its ancestors and itself). Slots ``p < k`` of step
        ``k`` have no such node and are garbage: the loss masks them."""
        features = self.from_target(features)
        bsz, length, hidden = features.shape
        block, attn = self.layer, self.layer.attn
        rope = target._rope(0, length) if target._inv_freq is not None else None  # what extend's positions get
        feature = torch.cat([features.new_zeros(bsz, 1, hidden), features[:, :-1]], dim=1)
        keys: list[tuple[torch.Tensor, torch.Tensor]] = []  # (k, v) of each step, [B, heads, T, D]
        outs = []
        slot = torch.arange(length, device=tokens.device)
        for k in range(steps):
            x = self.inputs(tokens, feature, target)
            h = block.attn_norm(x)
            q, key, value = _qkv(attn, h, rope)
            keys.append((key, value))
            k0, v0 = keys[0]
            reps = attn.n_heads // attn.n_kv_heads
            scores = [q.matmul(_expand(k0, reps).transpose(-1, -2))]
            scores[0] = scores[0].masked_fill(slot[None, :] > slot[:, None] - k, float("-inf"))
            diag_values = []
            for j in range(1, k + 1):
                kj, vj = (_shift(t, k - j) for t in keys[j])
                scores.append((q * _expand(kj, reps)).sum(-1, keepdim=True))
                diag_values.append(_expand(vj, reps))
            weights = torch.cat(scores, dim=-1).mul(1 / math.sqrt(attn.head_dim)).softmax(-1)
            out = weights[..., :length].matmul(_expand(v0, reps))
            for j, vj in enumerate(diag_values):
                out = out + weights[..., length + j : length + j + 1] * vj
            x = x + attn.wo(out.transpose(1, 2).reshape(bsz, length, -1))
            x = x + block.mlp(block.mlp_norm(x))
            outs.append(x)
            feature = torch.cat([x.new_zeros(bsz, 1, hidden), x[:, :-1]], dim=1)
        return outs


UNIT_RMS_EPS = 1e-6


def unit_rms(x: torch.Tensor, eps: float = UNIT_RMS_EPS) -> torch.Tensor:
    """``x`` scaled to unit RMS over its last dimension (a zero feature stays zero)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _qkv(attn, h: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys, values ``[B, heads, T, D]`` of ``attn`` on ``h``, as ``Attention.forward``."""
    bsz, length, _ = h.shape
    q_size, kv_size = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
    qk, v = attn.wqkv(h).split([q_size + kv_size, kv_size], dim=-1)
    qk = qk.view(bsz, length, attn.n_heads + attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    if rope is not None:
        qk = apply_rope(qk, *rope)
    q, k = qk.split([attn.n_heads, attn.n_kv_heads], dim=1)
    return q, k, v.view(bsz, length, attn.n_kv_heads, attn.head_dim).transpose(1, 2)


def _expand(t: torch.Tensor, reps: int) -> torch.Tensor:
    return t if reps == 1 else t.repeat_interleave(reps, dim=1)


def _shift(t: torch.Tensor, by: int) -> torch.Tensor:
    """``t`` moved ``by`` slots later along dim 2 (zeros in front)."""
    if by == 0:
        return t
    return torch.cat([t.new_zeros(*t.shape[:2], by, t.shape[3]), t[:, :, :-by]], dim=2)


FILES = HeadFiles(EAGLE_KIND, "EAGLE drafter", "quickdraft train heads --kind eagle --target ...")


def is_eagle_dir(path: str | Path) -> bool:
    return FILES.is_dir(path)


def save_eagle(head: EagleHead, target: Transformer, target_name: str, out: str | Path) -> None:
    """Write ``config.json`` + ``model.safetensors`` (fp32) to ``out``."""
    cfg = EagleConfig(target.config.hidden_size, target.config.vocab_size, head.draft_vocab, target_name,
                      target_fingerprint(target), layer=head.layer_shape,
                      feature_layers=list(head.feature_layers) if head.fused else None)
    FILES.save(out, cfg, head.state_dict())


def read_eagle_config(path: str | Path) -> EagleConfig:
    """The config of the drafter in ``path``; a one-line CheckpointError when there is none."""
    return FILES.read_config(path, EagleConfig)


def load_eagle(path: str | Path, target: Transformer, draft_vocab: int | None = None) -> EagleHead:
    """The drafter trained for ``target``; a one-line CheckpointError when it is not an
    EAGLE drafter or was trained on another target. ``draft_vocab``: how many of its rows,
    the most frequent tokens first (its ``draft_vocab.json``), it scores: None its default,
    0 all (a ValueError for a number it cannot give)."""
    cfg = read_eagle_config(path)
    tc = target.config
    FILES.check_target(path, cfg, (cfg.hidden_size, cfg.vocab_size) == (tc.hidden_size, tc.vocab_size),
                       target_fingerprint(target))
    ids = read_draft_vocab(path, draft_vocab)
    tensors = FILES.read_weights(path)
    try:
        head = EagleHead(target, tensors.get("vocab_ids"), cfg.layer, cfg.feature_layers)
        head.load_state_dict(tensors)
    except (RuntimeError, ValueError) as exc:
        raise CheckpointError(f"cannot read EAGLE drafter {path}: {str(exc).splitlines()[0]}") from None
    if ids is not None:
        head.restrict_vocab(ids)
    weight = target.embed.weight
    return head.to(device=weight.device, dtype=weight.dtype).eval().requires_grad_(False)
