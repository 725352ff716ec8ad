"""Early exit: the target's first L layers plus an exit head draft a chain (self-speculation).

With ``share_kv`` (the default) the drafter runs layers ``[0, L)`` straight into the
target's KV cache: those keys and values are exactly what the target writes for the same
tokens, so the proposal carries the layer-L hidden states of everything the verify pass
feeds and verification runs only layers ``[L, N)``. The target's ``compact`` then keeps
the accepted rows of every layer. The last drafted token goes through layers ``[0, L)``
too (its hidden state is needed), but not through the head.

Without sharing, the draft keeps its own cache of layers ``[0, L)`` and the target
recomputes every layer in verification: the A/B that measures what sharing saves.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch

from ..decoding.drafter import check_single_slot
from ..decoding.proposal import EMPTY, Proposal
from ..decoding.sampling import SamplingParams
from ..models.decode_linear import use_decode_linears
from ..models.exit_head import FILES as EXIT_FILES
from ..models.exit_head import ExitHead, ExitHeadConfig, load_exit_head, read_head_config
from ..models.kv_cache import KVCache
from ..models.lm import EARLY_EXIT_NEEDS_NATIVE, CausalLM, NativeLM
from .shapes import Shape
from .shipped import shipped_for


def check_exit_layer(target: CausalLM, exit_layer: int) -> None:
    """A one-line ValueError unless ``exit_layer`` leaves layers after it in ``target``."""
    n_layers = target.config.n_layers
    if not 1 <= exit_layer < n_layers:
        raise ValueError(f"--exit-layer must be in 1..{n_layers - 1} for this target ({n_layers} layers), "
                         f"got {exit_layer}")


def step_head(target: NativeLM, head: ExitHead, decode_linears: bool | None = None) -> ExitHead:
    """A copy of ``head`` in the target's dtype to run draft steps with, its linears
    (translator, extra block) swapped for decode linears when ``decode_linears`` (default:
    when the target has them). Without that, the extra block's one-row products take MKL's
    slower path and a draft step with it cost 1.6x a target layer (measured on the
    embedded target). With :attr:`ExitHead.draft_ids` (``--draft-vocab``) the copy scores
    only those tokens (:meth:`ExitHead.restrict_vocab`). ``head`` itself is left as it is."""
    head = copy.deepcopy(head).to(target.model.embed.weight.dtype)
    if head.draft_ids is not None:
        head.restrict_vocab(target.model)
    if target.decode_linears if decode_linears is None else decode_linears:
        use_decode_linears(head)
    return head


class EarlyExitDrafter:
    """Drafts a chain with the target's layers ``[0, head.exit_layer)`` and ``head``.

    ``stop_policy`` (an object with ``max_depth(k)``, ``keep_going(depth, q)`` and
    ``observe(drafted, accepted)``, see ``--draft-stop``) may end a chain early; None
    drafts k tokens every step.

    One sequence at a time (slot 0): it drafts in the target's own batch-1 KV cache (or a
    batch-1 cache of its own); ``BatchedEarlyExit`` drafts for many rows.
    """

    def __init__(self, target: CausalLM, head: ExitHead, share_kv: bool = True, stop_policy=None) -> None:
        if not isinstance(target, NativeLM):
            raise ValueError(EARLY_EXIT_NEEDS_NATIVE)
        check_exit_layer(target, head.exit_layer)
        self.lm, self.net, self.head = target, target.model, head.to(target.model.embed.weight.dtype)
        self.step_head = step_head(target, self.head)
        self.exit_layer, self.share_kv, self.stop_policy = head.exit_layer, share_kv, stop_policy
        self.name = f"early-exit(L={self.exit_layer},{head.kind}{'' if share_kv else ',no-share'})"
        self.shape = Shape()
        self.params, self.generator = SamplingParams(), torch.Generator()
        self.base_cache: KVCache | None = None  # own cache of layers [0, L) (no sharing)
        self.head_cache: KVCache | None = None  # the extra block's cache
        self.base_len = self.head_len = 0  # tokens in each of those caches
        # Layer-L states of the tokens right after head_len that the extra block has not
        # read yet (with sharing, the last drafted token's: see _run).
        self.pending: torch.Tensor | None = None
        self._fed = self._drafted = 0  # nodes of the last proposal fed to layers [0, L) / drafted

    def verify_width(self, k: int) -> int:
        return k + 1

    def join(self, slot: int, prompt: torch.Tensor, params: SamplingParams, generator: torch.Generator,
             max_len: int) -> None:
        check_single_slot(self, slot)
        self.params, self.generator = params, generator
        like = self.net.embed.weight
        if not self.share_kv and (self.base_cache is None or self.base_cache.max_len < max_len):
            config = dataclasses.replace(self.net.config, n_layers=self.exit_layer)
            self.base_cache = KVCache(config, 1, max_len, dtype=like.dtype, device=like.device)
        if self.head.block is not None and (self.head_cache is None or self.head_cache.max_len < max_len):
            self.head_cache = self.head.new_cache(1, max_len, like)
        self.base_len = self.head_len = 0
        self.pending = None

    def _cached(self) -> int:
        """Tokens whose layers [0, L) keys and values are cached and whose layer-L states
        the extra block has read or holds pending."""
        base = self.lm.length if self.share_kv else self.base_len
        if self.head.block is None:
            return base
        return min(base, self.head_len + (0 if self.pending is None else self.pending.shape[1]))

    @torch.inference_mode()
    def _run(self, tokens: torch.Tensor, start: int, logits: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layers [0, L) (and the head's extra block) over ``tokens`` at positions
        ``start..``: their hidden states ``[T, H]`` and the exit head's logits of the last."""
        cache = self.lm.cache if self.share_kv else self.base_cache
        tokens = tokens.to(cache.k.device, non_blocking=True)
        hidden = self.net(tokens[None], start, cache, layers=(0, self.exit_layer), logits="none").hidden
        if not logits:
            # The last drafted token (sharing): verification needs its layer-L state, but
            # the extra block only when the token is accepted, so the block reads it with
            # the next step's first pass instead of now (saves a one-token block pass).
            self.pending = hidden if self.head.block is not None else None
            return hidden[0], None
        block_start = start
        if self.pending is not None:  # states of the tokens just before ``start`` (see verified)
            hidden_in, block_start = torch.cat([self.pending, hidden], dim=1), start - self.pending.shape[1]
            self.pending = None
        else:
            hidden_in = hidden
        x = self.step_head.transform(hidden_in, self.net, block_start, self.head_cache)
        return hidden[0], self.step_head.logits(x[:, -1], self.net)[0] if logits else None

    def propose(self, slots: Sequence[int], sequences: Sequence[torch.Tensor], ks: Sequence[int]) -> list[Proposal]:
        (k,) = ks  # one sequence: slot 0 (join refused any other)
        return [self._draft(sequences[0], k) if k > 0 else EMPTY]

    def _draft(self, sequence: torch.Tensor, k: int) -> Proposal:
        """The chain of at most ``k`` tokens after ``sequence``."""
        length = sequence.shape[0]
        start = self._cached()
        hidden, logits = self._run(sequence[start:], start)
        # The verify pass feeds what the target's cache lacks: the hidden rows from there.
        hiddens = [hidden[self.lm.length - start :]] if self.share_kv else []
        policy = self.stop_policy
        depth_limit = k if policy is None else max(1, min(k, policy.max_depth(k)))
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        self._fed = 0
        for depth in range(depth_limit):
            node = self.shape.children(depth, None, depth - 1, logits, self.params, self.generator)[0]
            tokens.append(node.token)
            if node.q is not None:
                probs.append(node.q)
            last = depth + 1 == depth_limit
            if not last and policy is not None:
                q = node.q if node.q is not None else logits.float().softmax(-1)
                last = not policy.keep_going(depth + 1, q)
            if last and not self.share_kv:
                break  # nothing needs the last token's logits (the next step feeds it)
            # With sharing the last token goes through layers [0, L) too: verification
            # resumes from its hidden state.
            hidden, logits = self._run(torch.tensor([node.token]), length + depth, logits=not last)
            self._fed += 1
            hiddens.append(hidden)
            if last:
                break
        self.base_len = length + self._fed
        self.head_len = self.base_len - (0 if self.pending is None else self.pending.shape[1])
        self._drafted = len(tokens)
        proposal = Proposal.chain(torch.tensor(tokens, dtype=torch.long), torch.stack(probs) if probs else None)
        if self.share_kv:
            proposal.hidden, proposal.start_layer = torch.cat(hiddens), self.exit_layer
        return proposal

    def verified(self, slot: int, length: int, path: list[int]) -> None:
        # Chains: the accepted nodes are a prefix, already in place. With sharing the
        # target's compact already kept them (every layer) and dropped the rest.
        kept = length + min(len(path), self._fed)
        self.base_len = kept
        if self.pending is not None:  # keep the pending states of accepted tokens only
            self.pending = self.pending[:, : kept - self.head_len] if kept > self.head_len else None
        self.head_len = min(self.head_len, kept)
        if self.stop_policy is not None:
            self.stop_policy.observe(self._drafted, len(path))

    def leave(self, slot: int) -> None:
        pass


SHARED = "shared"


def shipped_heads(target: CausalLM) -> list[Path]:
    """The packaged exit heads trained on this target: the one marked ``default`` first,
    then head-only ones before extra-block ones."""
    configs = {path: read_head_config(path) for path in shipped_for(target, EXIT_FILES, ExitHeadConfig)}
    return sorted(configs, key=lambda path: (not configs[path].default, configs[path].extra_block))


def shipped_head(target: CausalLM) -> Path | None:
    """The default exit head for this target: the first of :func:`shipped_heads`, if any."""
    heads = shipped_heads(target)
    return heads[0] if heads else None


def default_exit_layer(n_layers: int) -> int:
    """The exit layer of a shared head when nothing chose one (``SpeculativeGenerator``
    asks the cost model first): half the depth."""
    return max(1, n_layers // 2)


def resolve_exit_head(target: CausalLM, head: str | ExitHead | None, exit_layer: int | None,
                      draft_vocab: int | None = None) -> ExitHead:
    """The exit head ``--draft``/``--exit-layer`` ask for: a head directory, ``shared`` (the
    target's final norm + LM head at ``exit_layer``), or None: the shipped head for this
    target (at its layer) unless ``exit_layer`` asks for another layer, else shared. A
    loaded :class:`ExitHead` is returned as it is. ``draft_vocab``: how many of its most
    frequent tokens a trained head's draft steps score (``load_exit_head``)."""
    if not isinstance(target, NativeLM):
        raise ValueError(EARLY_EXIT_NEEDS_NATIVE)
    if exit_layer is not None:
        check_exit_layer(target, exit_layer)
    if isinstance(head, ExitHead):  # already loaded (a drafter's head, passed on to a batch)
        if exit_layer not in (None, head.exit_layer):
            raise ValueError(f"the exit head exits after layer {head.exit_layer}, not --exit-layer {exit_layer}")
        return head
    n_layers = target.config.n_layers
    path = shipped_head(target) if head is None else None if head == SHARED else Path(head).expanduser()
    if path is not None:
        config = read_head_config(path)
        if exit_layer is None or exit_layer == config.exit_layer:
            return load_exit_head(path, target.model, draft_vocab)
        if head is not None:
            raise ValueError(f"the exit head {path} exits after layer {config.exit_layer}, not --exit-layer "
                             f"{exit_layer}; drop --exit-layer, or train a head for layer {exit_layer}")
        # the shipped head is for another layer: the shared head at the layer asked for
    if draft_vocab:
        raise ValueError(f"--draft-vocab {draft_vocab} needs a trained exit head (its draft_vocab.json ranks the "
                         "tokens); the shared head has none: drop --draft-vocab or pass a head with --draft DIR")
    layer = exit_layer or (read_head_config(path).exit_layer if path is not None else default_exit_layer(n_layers))
    return ExitHead(target.config, layer, trained=False)


def early_exit_drafter(target: CausalLM, options, stop_policy=None) -> EarlyExitDrafter:
    """The early-exit drafter of ``DraftOptions`` (``exit_head``, ``exit_layer``, ``share_kv``)."""
    head = resolve_exit_head(target, options.exit_head, options.exit_layer, options.draft_vocab)
    return EarlyExitDrafter(target, head, options.share_kv, stop_policy)
