"""One forward pass over a ragged batch: every row feeds its own number of tokens after its
own cached length, and gets back the logits of its own last tokens.

The rows' tokens are packed one after another into a single sequence (batch 1): no row is
padded to another's width, so a pass costs the tokens it feeds (a 100-token prompt
prefilled next to a 1400-token one used to be padded to 1400).

Batch invariance (a row's logits do not depend, bit for bit, on the other rows) needs
identical per-row arithmetic, so:

- attention runs row by row over the row's own tokens and cache (``RaggedRow``; on a GPU
  in one padded call instead, ``transformer.PaddedRows``: no bit-for-bit promise there);
- every matrix product has a *canonical* row count (``decode_linear.canonical_rows``):
  with the native decode linears (oneDNN) every count is canonical; with plain
  ``nn.Linear`` (MKL) the packed sequence is padded at its end up to such a count (the
  padding writes no cache and nobody attends to it), so each row is rounded the same way
  whatever the batch holds. Norms, RoPE, activations and the embedding are per token
  already.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .decode_linear import canonical_rows, invariant_rows
from .kv_cache import KVCache
from .transformer import RaggedRow, Transformer

if TYPE_CHECKING:
    from .exit_head import ExitHead


@dataclass(frozen=True)
class Feed:
    """What one row feeds: ``tokens`` (``[n]``, n >= 1) written after the ``start`` tokens its
    cache row ``cache_row`` holds; ``logits`` of its last ``logits`` tokens are wanted (0: none)."""

    cache_row: int
    start: int
    tokens: torch.Tensor
    logits: int


@torch.inference_mode()
def ragged_forward(model: Transformer, cache: KVCache, feeds: Sequence[Feed],
                   layers: tuple[int, int] | None = None, head: ExitHead | None = None,
                   head_cache: KVCache | None = None) -> list[torch.Tensor]:
    """Run ``feeds`` in one pass; per feed the logits ``[feed.logits, V]`` of its last tokens
    (None for 0).

    Early exit's draft pass: ``layers`` (``(0, L)``) runs only those layers and ``head``,
    an exit head (its extra block's cache: ``head_cache``), gives the logits in place of the
    final norm + LM head. Its products must round rows alike too: plain ``nn.Linear`` in
    the head rounds a row by the pass's canonical shape, decode linears by themselves."""
    return _ragged(model, cache, feeds, layers, head, head_cache)[0]


@torch.inference_mode()
def ragged_forward_keeping(model: Transformer, cache: KVCache, feeds: Sequence[Feed],
                           layers: Sequence[int]) -> tuple[list[torch.Tensor], list[dict[int, torch.Tensor]]]:
    """:func:`ragged_forward` of the whole target that also keeps, per feed, the hidden
    states ``layers`` (numbered as ``Transformer.forward``'s ``output_hidden_states``: the
    stream entering layer ``i``; ``n_layers`` is the final one, before the norm) at each of
    its tokens, ``{layer: [n, H]}`` (views of the pass's activations, nothing copied): what
    an early-exit drafter reads instead of running the first layers over a prompt again,
    and what a head drafter reads of the target."""
    return _ragged(model, cache, feeds, keep=tuple(layers))


#: KVCache -> the model's one-call pass over it (``Transformer.forward_call``), or None where
#: it cannot run: set up at a cache's first lone-row pass (the check walks every layer).
_ONE_CALLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _lone_row(model: Transformer, cache: KVCache, feed: Feed, keep: tuple[int, ...]):
    """A pass of one row as one C call (what the batched engine's steps are while one row
    is active, and what a lone generation's are): the same logits, states and cache bit for
    bit as the ragged pass (each row of which runs the same kernels in the same order), or
    None where the call cannot run (nothing fed)."""
    if cache not in _ONE_CALLS:
        _ONE_CALLS[cache] = model.forward_call(cache)
    call = _ONE_CALLS[cache]
    final = model.config.n_layers
    if (call is None or any(not 0 < layer <= final for layer in keep)
            or feed.start + feed.tokens.numel() > cache.max_len):  # (the ragged pass raises the error)
        return None
    tokens = feed.tokens if feed.tokens.dtype == torch.long else feed.tokens.to(torch.long)
    cos, sin = model._rope(feed.start, tokens.numel())
    out = call(tokens.contiguous(), feed.start, (cos[0, 0], sin[0, 0]), feed.logits, feed.cache_row, states=keep)
    if out is None:  # a token the embedding lacks: the ragged pass raises the error
        return None
    return [out[1]], [out[2]]


def _ragged(model: Transformer, cache: KVCache, feeds: Sequence[Feed], layers: tuple[int, int] | None = None,
            head: ExitHead | None = None, head_cache: KVCache | None = None, keep: tuple[int, ...] = ()):
    invariant = invariant_rows(model)
    if (len(feeds) == 1 and layers is None and head is None and feeds[0].tokens.device.type == "cpu"
            and canonical_rows(feeds[0].tokens.numel(), invariant) == feeds[0].tokens.numel()
            and canonical_rows(feeds[0].logits, invariant) == feeds[0].logits):
        out = _lone_row(model, cache, feeds[0], keep)
        if out is not None:
            return out
    ragged, total = [], 0
    for f in feeds:
        ragged.append(RaggedRow(f.cache_row, f.start, f.tokens.numel(), total))
        total += f.tokens.numel()
    width = canonical_rows(total, invariant)  # MKL: padding at the end, up to a canonical count
    if len(feeds) == 1:  # the common decode step: no concatenation
        f = feeds[0]
        tokens, positions = f.tokens, torch.arange(f.start, f.start + total)
    else:
        tokens = torch.cat([f.tokens for f in feeds])
        positions = torch.cat([torch.arange(f.start, f.start + f.tokens.numel()) for f in feeds])
    if width > total:
        tokens = torch.cat([tokens, tokens.new_zeros(width - total)])
        positions = torch.cat([positions, positions.new_zeros(width - total)])
    device = model.embed.weight.device  # rows' buffers live on the CPU: one copy to a GPU
    tokens = tokens.view(1, width).to(device, non_blocking=True)
    positions = positions.view(1, width).to(device, non_blocking=True)
    out = model(tokens, positions, cache, layers=layers, logits="none", ragged=ragged, output_hidden_states=keep)
    hidden = out.hidden
    kept = [{i: out.hidden_states[i][0, r.offset : r.offset + r.tokens] for i in keep} for r in ragged]
    if head is not None:
        hidden = head.transform(hidden, model, positions, head_cache, None, ragged)
    picks = [r.offset + r.tokens - f.logits + i for r, f in zip(ragged, feeds) for i in range(f.logits)]
    if not picks:
        return [None] * len(feeds), kept
    if picks == list(range(picks[0], picks[-1] + 1)):  # one run (e.g. every token of every row): a view
        flat = hidden[0, picks[0] : picks[-1] + 1]
    else:
        flat = hidden[0, torch.tensor(picks).to(hidden.device, non_blocking=True)]
    count = canonical_rows(len(picks), invariant)
    if count > len(picks):
        flat = torch.cat([flat, flat.new_zeros(count - len(picks), flat.shape[-1])])
    logits = (model.head(flat) if head is None else head.logits(flat, model))[: len(picks)]
    out, at = [], 0
    for f in feeds:
        out.append(logits[at : at + f.logits] if f.logits else None)
        at += f.logits
    return out, kept
