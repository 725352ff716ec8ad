"""One forward pass over a ragged batch: every row feeds its own number of tokens after its
own cached length, and gets back the logits of its own last tokens.

Batch invariance (a row's logits do not depend, bit for bit, on the other rows) needs
identical per-row arithmetic, so:

- attention runs row by row over the row's real tokens and cache (``RaggedRow``); padding
  is never visible to anyone, the row itself included;
- every matrix product has a *canonical* row count (``decode_linear.canonical_rows``):
  with the native decode linears (oneDNN) every count is canonical; with plain
  ``nn.Linear`` (MKL) the batch is padded with padding tokens (more columns) or padding
  rows (a scratch cache row) up to the cheapest such count, so each row is rounded the
  same way whatever the batch holds. Norms, RoPE, activations and the embedding are per
  token already.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .decode_linear import canonical_rows, invariant_rows
from .kv_cache import KVCache
from .transformer import RaggedRow, Transformer

if TYPE_CHECKING:
    from .exit_head import ExitHead

MAX_PAD = 12  # padding tokens or rows tried when looking for the cheapest canonical shape


@dataclass(frozen=True)
class Feed:
    """What one row feeds: ``tokens`` (``[n]``, n >= 1) written after the ``start`` tokens its
    cache row ``cache_row`` holds; ``logits`` of its last ``logits`` tokens are wanted (0: none)."""

    cache_row: int
    start: int
    tokens: torch.Tensor
    logits: int


def padded_shape(rows: int, width: int, invariant: bool = False) -> tuple[int, int]:
    """(rows, width) >= the given ones with a canonical product ``rows * width``, the one
    with the fewest tokens (then the fewest padding rows)."""
    if invariant:
        return rows, width
    best = None
    for w in range(width, width + MAX_PAD + 1):
        for r in range(rows, rows + MAX_PAD + 1):
            if canonical_rows(r * w) == r * w:
                if best is None or (r * w, r) < (best[0] * best[1], best[0]):
                    best = (r, w)
                break
    return best


@torch.inference_mode()
def ragged_forward(model: Transformer, cache: KVCache, feeds: Sequence[Feed], scratch_row: int,
                   layers: tuple[int, int] | None = None, head: ExitHead | None = None,
                   head_cache: KVCache | None = None) -> list[torch.Tensor]:
    """Run ``feeds`` in one pass; per feed the logits ``[feed.logits, V]`` of its last tokens
    (None for 0). ``scratch_row`` is a cache row no real row uses (padding rows write there).

    Early exit's draft pass: ``layers`` (``(0, L)``) runs only those layers and ``head``,
    an exit head (its extra block's cache: ``head_cache``), gives the logits in place of the
    final norm + LM head. Its products must round rows alike too: plain ``nn.Linear`` in
    the head rounds a row by the pass's canonical shape, decode linears by themselves."""
    return _ragged(model, cache, feeds, scratch_row, layers, head, head_cache)[0]


@torch.inference_mode()
def ragged_forward_keeping(model: Transformer, cache: KVCache, feeds: Sequence[Feed], scratch_row: int,
                           layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`ragged_forward` of the whole target that also keeps, per feed, the residual
    stream entering ``layer`` at each of its tokens (``[n, H]``): what an early-exit
    drafter reads instead of running the first layers over a prompt again."""
    return _ragged(model, cache, feeds, scratch_row, keep=layer)


def _ragged(model: Transformer, cache: KVCache, feeds: Sequence[Feed], scratch_row: int,
            layers: tuple[int, int] | None = None, head: ExitHead | None = None,
            head_cache: KVCache | None = None, keep: int | None = None):
    width = max(f.tokens.numel() for f in feeds)
    invariant = invariant_rows(model)
    rows, width = padded_shape(len(feeds), width, invariant)
    context = model.config.max_position_embeddings
    ragged = [RaggedRow(f.cache_row, f.start, f.tokens.numel()) for f in feeds]
    ragged += [RaggedRow(scratch_row, 0, 0)] * (rows - len(feeds))
    if rows == 1 and ragged[0].tokens == width:  # one row, no padding: the common decode step
        tokens = feeds[0].tokens.view(1, width)
    else:
        tokens = torch.zeros(rows, width, dtype=torch.long)
        for b, f in enumerate(feeds):
            tokens[b, : f.tokens.numel()] = f.tokens
    slots = torch.tensor([r.start for r in ragged])[:, None] + torch.arange(width)
    positions = slots.clamp(max=context - 1)  # padding may run past the context; real tokens never do
    out = model(tokens, positions, cache, slots=slots, layers=layers, logits="none", ragged=ragged,
                output_hidden_states=() if keep is None else (keep,))
    hidden = out.hidden
    kept = [] if keep is None else [out.hidden_states[keep][b, : f.tokens.numel()] for b, f in enumerate(feeds)]
    if head is not None:
        hidden = head.transform(hidden, model, positions, head_cache, slots, ragged)
    picks = [b * width + f.tokens.numel() - f.logits + i for b, f in enumerate(feeds) for i in range(f.logits)]
    if not picks:
        return [None] * len(feeds), kept
    if picks == list(range(picks[0], picks[-1] + 1)):  # one run (one row): a view, no gather
        flat = hidden.reshape(rows * width, -1)[picks[0] : picks[-1] + 1]
    else:
        flat = hidden.reshape(rows * width, -1)[torch.tensor(picks)]
    total = canonical_rows(len(picks), invariant)
    if total > len(picks):
        flat = torch.cat([flat, flat.new_zeros(total - len(picks), flat.shape[-1])])
    logits = (model.head(flat) if head is None else head.logits(flat, model))[: len(picks)]
    out, at = [], 0
    for f in feeds:
        out.append(logits[at : at + f.logits] if f.logits else None)
        at += f.logits
    return out, kept
