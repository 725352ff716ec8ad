"""Drafters for many rows at once: model drafters that batch their draft passes.

Every drafter has the one interface of ``decoding/drafter.py``: it sees rows by their
cache slot, proposes for all of them in one ``propose`` (row ``i`` gets at most ``ks[i]``
tokens) and hears per row what was accepted (``verified``); rows ``join`` and ``leave``
between steps. The ones here keep a batched KV cache of their own (a row per slot), so
they serve the batched engine's rows, and slot 0 of the batch-1 loop too. Their
proposals are chains: token trees stay batch 1.

- :class:`BatchedDraftModel`: the draft model, one batched draft forward per draft
  position with its own batched KV cache (ragged, batch invariant, like the target's).
- :class:`BatchedEarlyExit`: early exit, the target's first L layers + an exit head,
  drafting like the draft model (both are a :class:`BatchedChain`) into cache rows of
  its own.
- the head methods (Medusa, prophet, EAGLE): a chain drafter per row
  (:mod:`.per_row`), their heads shared.

Plain decoding (``NoDrafter``), n-gram lookup (``NgramDrafter``, no state) and the hybrid
(``HybridDrafter`` over a ``BatchedDraftModel``) serve many rows as they are.

A drafter that runs the target's first layers may also take a joining row's prefill from
the target's prefill pass instead of running those layers itself: it names the layer
(``adopts_layer``) and the engine hands it the stream entering that layer (``adopt``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ..decoding.drafter import Drafter, NoDrafter
from ..decoding.proposal import EMPTY, Proposal
from ..decoding.sampling import SamplingParams, choose_rows
from ..models.decode_linear import invariant_rows, row_dependent_rounding
from ..models.exit_head import ExitHead
from ..models.kv_cache import KVCache
from ..models.lm import NativeLM
from ..models.ragged import Feed, ragged_forward
from ..models.transformer import RaggedRow
from .draft_model import present_logits
from .early_exit import check_exit_layer, resolve_exit_head, step_head
from .factory import BATCH_METHODS, DraftOptions, hybrid_eagle_chain, ngram_drafter
from .hybrid import HybridDrafter
from .per_row import HEAD_BATCH_K, per_row_head_drafter


class BatchedChain:
    """A model drafting a chain for every row: draft position ``d`` is one batched
    ``forward`` over the rows still drafting (row ``i`` drafts ``ks[i]`` tokens), into a
    KV cache of the drafter's own (a row per slot).

    As the single-sequence drafters do, each row's first pass feeds what its cache lacks
    (the last token, or a catch-up after accepted tokens), the last drafted token is never
    fed, and each token is chosen with ``sampling.choose`` and the row's own generator, so
    a row's draft (and the random numbers it consumes) is the one it gets alone.
    A row's prefill waits for its first proposal: while the batch policy keeps k at 0
    (plain decoding), the drafter costs nothing. It then runs alone, as
    ``DraftModelDrafter.join`` does, so the row's draft is the same.
    Subclasses give ``forward`` (a ragged pass over the drafter's cache) and build a cache
    of ``max_len`` tokens per slot.
    """

    name = "chain"
    #: The target layer whose input this drafter can take from the target's prefill pass
    #: instead of prefilling a row itself (:meth:`BatchedEarlyExit.adopt`); None: it cannot.
    adopts_layer: int | None = None

    def __init__(self, target_vocab_size: int, max_batch_size: int, max_len: int) -> None:
        self.vocab_size = target_vocab_size
        self.max_len = max_len
        self.lengths = [0] * max_batch_size
        self.params: dict[int, SamplingParams] = {}
        self.generators: dict[int, torch.Generator] = {}

    def forward(self, feeds: Sequence[Feed]) -> list[torch.Tensor]:
        """One ragged pass of the drafter over ``feeds`` (``models.ragged.ragged_forward``)."""
        raise NotImplementedError

    def verify_width(self, k: int) -> int:
        return k + 1

    def join(self, slot: int, prompt: torch.Tensor, params: SamplingParams, generator: torch.Generator,
             max_len: int) -> None:
        if not 0 <= slot < len(self.lengths):
            raise ValueError(f"the {self.name} drafter has {len(self.lengths)} slots, not slot {slot}")
        if max_len > self.max_len:
            raise ValueError(f"the {self.name} drafter keeps {self.max_len} tokens per row, "
                             f"this row needs {max_len}; build it with a larger max_len")
        self.params[slot], self.generators[slot] = params, generator
        self.lengths[slot] = 0

    def _prefill(self, slot: int, sequence: torch.Tensor) -> None:
        """A row's prefill: its sequence but the last token, alone (in the batched pass it
        would pad every other row to its length; it has no logits to give)."""
        self.forward([Feed(slot, 0, sequence[:-1], 0)])
        self.lengths[slot] = sequence.numel() - 1

    def propose(self, slots: Sequence[int], sequences: Sequence[torch.Tensor], ks: Sequence[int]) -> list[Proposal]:
        chains: list[list[int]] = [[] for _ in slots]
        probs: list[list[torch.Tensor]] = [[] for _ in slots]
        for slot, sequence, k in zip(slots, sequences, ks):
            if k > 0 and self.lengths[slot] == 0 and sequence.numel() > 1:
                self._prefill(slot, sequence)
        for depth in range(max(ks, default=0)):
            rows = [i for i, k in enumerate(ks) if k > depth]
            feeds = []
            for i in rows:
                slot = slots[i]
                fed = sequences[i][self.lengths[slot] :] if depth == 0 else torch.tensor(chains[i][-1:])
                feeds.append(Feed(slot, self.lengths[slot], fed, 1))
                self.lengths[slot] += fed.numel()
            logits = self.forward(feeds)
            chosen = choose_rows([present_logits(row[0], self.vocab_size) for row in logits],
                                 [self.params[slots[i]] for i in rows], [self.generators[slots[i]] for i in rows])
            for i, (token, q) in zip(rows, chosen):
                chains[i].append(token)
                if q is not None:
                    probs[i].append(q)
        out = []
        for chain, q in zip(chains, probs):
            if not chain:
                out.append(EMPTY)
            else:
                out.append(Proposal.chain(torch.tensor(chain, dtype=torch.long), torch.stack(q) if q else None))
        return out

    def verified(self, slot: int, length: int, path: list[int]) -> None:
        # The cache holds the sequence's ``length`` tokens plus the chain's fed tokens; keep
        # the accepted ones (a chain's accepted nodes are a prefix: no moving).
        self.lengths[slot] = min(self.lengths[slot], length + len(path))

    def leave(self, slot: int) -> None:
        self.params.pop(slot, None)
        self.generators.pop(slot, None)


class BatchedDraftModel(BatchedChain):
    """The draft model drafting a chain for every row (ragged, batch invariant, like the
    target's pass)."""

    name = "draft"

    def __init__(self, draft: NativeLM, target_vocab_size: int, max_batch_size: int, max_len: int) -> None:
        super().__init__(target_vocab_size, max_batch_size, max_len)
        self.model = draft.model
        self.lm = draft
        self.cache = self.model.new_cache(max_batch_size, max_len)

    def forward(self, feeds):
        if len(feeds) == 1 and feeds[0].tokens.numel() == 1:
            # A pass over one row's one token is a lone sequence's draft step: it takes the
            # kernels DraftModelDrafter drafts a lone sequence with (row_dependent_rounding:
            # ~40% less per step on the embedded draft). A draft's rounding never changes
            # the target's greedy output nor the sampled distribution, and a row drafting
            # alone now drafts as it does in `quickdraft generate`: one stream is as fast.
            with row_dependent_rounding():
                return ragged_forward(self.model, self.cache, feeds)
        return ragged_forward(self.model, self.cache, feeds)


class BatchedEarlyExit(BatchedChain):
    """Early exit drafting a chain for every row: the target's layers ``[0, L)`` and the
    exit head, into a cache of the drafter's own (the target's shapes, layers ``[0, L)``
    only). The target's cache is never written: its verify pass recomputes every layer
    (the single-sequence drafter's ``share_kv=False``), so rows stay independent.

    With decode linears on the target the head gets its own decode-linear copy, so every
    product of the draft pass rounds a row alike whatever the batch holds."""

    def __init__(self, target: NativeLM, head: ExitHead, max_batch_size: int, max_len: int) -> None:
        super().__init__(target.vocab_size, max_batch_size, max_len)
        check_exit_layer(target, head.exit_layer)
        net = target.model
        like = net.embed.weight
        # Decode linears only where they round every row count alike (else the pass's
        # canonical shapes keep plain linears batch invariant).
        head = step_head(target, head, invariant_rows(net))
        self.net, self.head, self.layers = net, head, (0, head.exit_layer)
        self.name = f"early-exit(L={head.exit_layer},{head.kind})"
        config = dataclasses.replace(net.config, n_layers=head.exit_layer)
        self.cache = KVCache(config, max_batch_size, max_len, dtype=like.dtype, device=like.device)
        self.head_cache = head.new_cache(max_batch_size, max_len, like)

    def forward(self, feeds):
        return ragged_forward(self.net, self.cache, feeds, self.layers, self.head, self.head_cache)

    @property
    def adopts_layer(self) -> int:
        return self.layers[1]

    @torch.inference_mode()
    def adopt(self, slot: int, hidden: torch.Tensor, target_cache: KVCache) -> None:
        """A joining row's prefill, taken from the target's: the target's prefill pass
        already wrote layers ``[0, L)`` of the prompt to its cache row ``slot`` and gives
        ``hidden`` (``[n, H]``, the stream entering layer L at the n prompt tokens), so only
        the head's extra block runs (it fills its own cache). Half of what
        :meth:`_prefill` costs with a one-layer exit; a row's drafts then depend on the
        target's arithmetic for its prompt, its own whatever the batch holds."""
        n, exit_layer = hidden.shape[0], self.layers[1]
        self.cache.k[:exit_layer, slot, :, :n] = target_cache.k[:exit_layer, slot, :, :n]
        self.cache.v[:exit_layer, slot, :, :n] = target_cache.v[:exit_layer, slot, :, :n]
        if self.head.block is not None:
            self.head.transform(hidden[None], self.net, torch.arange(n)[None], self.head_cache, None,
                                [RaggedRow(slot, 0, n)])
        self.lengths[slot] = n


def make_batch_drafter(method: str, draft: NativeLM | None, target: NativeLM, max_batch_size: int,
                       max_len: int, options: DraftOptions = DraftOptions()) -> Drafter:
    """The drafter of ``method`` for up to ``max_batch_size`` rows of ``max_len`` tokens (ar,
    draft, ngram, hybrid, early-exit, and the head methods medusa, prophet, eagle and
    hybrid-eagle drafting a chain per row; ``options`` gives the n-gram sizes, the exit head
    and layer, the heads); trees, multi-draft and layer skip are batch 1 only."""
    if method == "ar":
        return NoDrafter()
    if method == "ngram":
        return ngram_drafter(method, options, target)
    if method not in BATCH_METHODS:
        raise ValueError(f"method {method!r} does not batch; batched decoding supports {', '.join(BATCH_METHODS)} "
                         "(token trees, multi-draft and layer skip are batch 1)")
    if method == "early-exit":
        head = resolve_exit_head(target, options.exit_head, options.exit_layer, options.draft_vocab)
        return BatchedEarlyExit(target, head, max_batch_size, max_len)
    if method == "hybrid-eagle":  # prompt lookup per row, else that row's EAGLE chain
        chain = hybrid_eagle_chain(options.tree)
        return HybridDrafter(ngram_drafter(method, options, target),
                             per_row_head_drafter("eagle", target, max_batch_size, options, chain),
                             fixed_k=HEAD_BATCH_K[method])
    if method in HEAD_BATCH_K:
        return per_row_head_drafter(method, target, max_batch_size, options)
    if draft is None:
        raise ValueError(f"--method {method} needs a draft model (--draft); ngram and ar need none")
    if not isinstance(draft, NativeLM):
        raise ValueError("batched decoding needs the native runtime for the draft (--backend native)")
    model = BatchedDraftModel(draft, target.vocab_size, max_batch_size, max_len)
    if method == "hybrid":
        return HybridDrafter(ngram_drafter(method, options, target), model)
    return model
