"""Engine-facing model handles: one sequence, a KV cache, ``extend``, ``crop``, ``compact``.

The decode loop only needs these operations, so any backend that offers them can be a
target or a draft: the native runtime (default; token trees too) or any ``transformers``
causal LM (chains only).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch

from . import cpu_kernels, gguf
from .config import ModelConfig, UnsupportedModelError
from .cpu_kernels import ForwardCall
from .decode_linear import use_decode_linears
from .hf_cache import forward_with_cache
from .loading import (
    CheckpointError,
    load_native,
    read_hf_config,
    resolve_model_dir,
    safetensors_files,
)
from .placement import Placement
from .shared_embed import fill_hf, missing_target_error, read_shared
from .static_step import StaticStep
from .transformer import Transformer, attention_kernels


class CausalLM(Protocol):
    """A language model decoding one sequence with a rollback-able KV cache."""

    backend: str
    vocab_size: int
    context_length: int
    length: int  # tokens currently in the cache
    eos_token_ids: list[int]
    #: The hidden states the last ``extend`` was asked for (``output_hidden_states``):
    #: ``{layer: [T, hidden_size]}`` over the tokens it fed; empty when none were asked for.
    hidden_states: dict[int, torch.Tensor]

    def reset(self, max_len: int | None = None) -> None:
        """Start a new sequence with room for ``max_len`` tokens."""

    def extend(
        self,
        tokens: torch.Tensor,
        logits: str | int = "all",
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
        start_layer: int = 0,
        output_hidden_states: Sequence[int] = (),
    ) -> torch.Tensor:
        """Append ``tokens`` (``[T]``) to the cache and return their logits: ``[T, V]`` for
        ``"all"``, ``[n, V]`` for an int ``n`` (the last n tokens), ``[1, V]`` for ``"last"``,
        None for ``"none"`` (prefill of a draft).

        ``positions`` (``[T]``, default: contiguous after the cache) and a boolean ``mask``
        (``[T, length + T]``, True = attend; default causal) feed a token tree: its nodes
        sit in consecutive cache slots but at position prefix + depth.

        ``hidden`` (``[T, hidden_size]``) resumes the pass at layer ``start_layer`` from
        these residual-stream states (early exit with a shared KV cache): the keys and
        values of the layers below it are already in the cache at these slots.

        ``output_hidden_states`` (layer numbers as in ``Transformer.forward``: ``i`` is the
        stream entering layer ``i``, ``n_layers`` the last layer's output before the final
        norm) keeps those states of the fed tokens in :attr:`hidden_states`, at no extra
        cost: what drafters that read the target (heads) consume."""

    def crop(self, length: int) -> None:
        """Roll the cache back to its first ``length`` tokens."""

    def compact(self, length: int, keep: list[int]) -> None:
        """Keep the first ``length`` tokens, then the tokens at slots ``length + keep[i]``
        moved to ``length + i`` (the accepted path of a tree); drop the rest."""


TREES_NEED_NATIVE = (
    "the transformers backend verifies chains only; token trees need the native runtime (--backend native)"
)

HIDDEN_STATES_NEED_NATIVE = (
    "drafters that read the target's hidden states need the native runtime (--backend native); "
    "this model runs on transformers"
)

EARLY_EXIT_NEEDS_NATIVE = (
    "early exit runs the target's own layers and shares its KV cache, which needs the native runtime "
    "(--backend native); this model runs on transformers"
)


def eos_token_ids(target: CausalLM, tokenizer) -> list[int]:
    """The ids that end a generation: the target's EOS ids, then the tokenizer's EOS id if
    the target lacks it; de-duplicated, order kept. ``tokenizer`` may be None."""
    ids = list(target.eos_token_ids)
    extra = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if extra is not None:
        ids.append(extra)
    return list(dict.fromkeys(ids))


class NativeLM:
    """The native transformer driving a single sequence (batch of one).

    With ``decode_linears`` (the default) its linear layers are swapped, in place, for
    CPU decode kernels (``DecodeLinear``) where the device and dtype allow it.

    Inputs may live on the CPU (the engine's sequence buffer, drafters' masks): ``extend``
    moves them to the model's device; logits and hidden states stay there.
    """

    backend = "native"

    def __init__(self, model: Transformer, model_dir: Path | None = None, decode_linears: bool = True) -> None:
        self.model = model
        self.decode_linears = decode_linears and use_decode_linears(model)
        self.device = model.embed.weight.device
        self.config: ModelConfig = model.config
        self.model_dir = model_dir
        self.vocab_size = self.config.vocab_size
        self.context_length = self.config.max_position_embeddings
        self.eos_token_ids = list(self.config.eos_token_ids)
        self.length = 0
        self.cache = None
        self.hidden_states: dict[int, torch.Tensor] = {}
        self.static_width, self.static_compile = 0, False  # (compile: False, True or a mode)
        self.static: StaticStep | None = None
        self.one_call: ForwardCall | None | bool = False  # set up at the first pass after a reset

    def use_static_step(self, width: int, compile: bool | str = False) -> None:
        """Run chain passes of up to ``width`` tokens (plain steps, verify passes) through a
        fixed-shape :class:`~quickdraft.models.static_step.StaticStep`, compiled with
        ``torch.compile(mode="reduce-overhead")`` (CUDA graphs) when ``compile`` (a string:
        that mode, e.g. ``"max-autotune"``); 0 turns it off. Other passes (prefills, trees,
        early exit, hidden states) stay eager."""
        if (width, compile) != (self.static_width, self.static_compile):
            self.static_width, self.static_compile, self.static = width, compile, None

    def reset(self, max_len: int | None = None) -> None:
        # Slots may run a tree's width past the context (positions never do), and a static
        # step's padding rows its width past the sequence.
        max_len = (max_len or self.context_length) + self.static_width
        if self.static_width:  # a new cache size is a new compiled graph: grow in powers of two
            max_len = max(max_len, min(1 << (max_len - 1).bit_length(), self.context_length + self.static_width))
        if self.cache is None or self.cache.max_len < max_len:
            self.cache = self.model.new_cache(1, max_len)
            self.static = None
        if self.static_width and self.static is None:
            self.static = StaticStep(self.model, self.cache, self.static_width, self.static_compile)
        self.length = 0
        self.one_call = False

    @torch.inference_mode()
    def extend(
        self,
        tokens: torch.Tensor,
        logits: str | int = "all",
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
        start_layer: int = 0,
        output_hidden_states: Sequence[int] = (),
    ) -> torch.Tensor:
        if self.cache is None:
            self.reset()
        end = self.length + tokens.shape[-1]
        if (self.static is not None and positions is None and mask is None and hidden is None
                and not output_hidden_states and tokens.shape[-1] <= self.static_width
                and self.length + self.static_width <= self.cache.max_len):
            out = self.static(tokens, self.length)
            self.hidden_states = {}
            self.length = end
            if logits == "none":
                return None
            return out if logits == "all" else out[-(1 if logits == "last" else logits) :]
        if positions is None and mask is None and hidden is None and end <= self.cache.max_len:
            out = self._one_call_pass(tokens, logits, output_hidden_states)
            if out is not None:
                self.length = end
                return out[0]
        # Slots are always contiguous after the cache (an int: slice writes, no gathers);
        # positions too, except in a token tree.
        slots = self.length
        # No-ops on the CPU; on a GPU, host-to-device copies (no host synchronisation).
        tokens = tokens.to(self.device, non_blocking=True)
        positions = slots if positions is None else positions.to(self.device, non_blocking=True).view(1, -1)
        if mask is not None:
            mask = mask.to(self.device, non_blocking=True)[None]
        if hidden is not None:
            hidden = hidden.to(self.device, non_blocking=True)
        if hidden is None:
            out = self.model(tokens.view(1, -1), positions, self.cache, slots=slots, mask=mask, logits=logits,
                             output_hidden_states=output_hidden_states)
        else:  # early exit: layers below start_layer are already in the cache
            out = self.model(None, positions, self.cache, slots=slots, mask=mask, logits=logits,
                             hidden=hidden[None], layers=(start_layer, self.config.n_layers),
                             output_hidden_states=output_hidden_states)
        self.hidden_states = {i: state[0] for i, state in out.hidden_states.items()}
        self.length = end
        return None if out.logits is None else out.logits[0]

    def _one_call_pass(self, tokens: torch.Tensor, logits: str | int,
                       output_hidden_states: Sequence[int]) -> tuple[torch.Tensor | None] | None:
        """A contiguous pass as one C call (``Transformer.forward_call``; the same results bit
        for bit, the states of any layers too), where it runs: ``(logits,)`` (the hidden
        states in ``hidden_states``), else None (nothing fed)."""
        if self.one_call is False:  # once a generation: the checks walk every layer's linears
            self.one_call = self.model.forward_call(self.cache)
        final = self.config.n_layers
        if self.one_call is None or any(not 0 < layer <= final for layer in output_hidden_states) or (
                type(logits) is int and logits < 1):
            return None
        ids = tokens.view(-1)
        if ids.dtype != torch.long or not ids.is_contiguous():
            ids = ids.to(torch.long).contiguous()
        m = ids.numel()
        rows = m if logits == "all" else 0 if logits == "none" else 1 if logits == "last" else min(logits, m)
        cos, sin = self.model._rope(self.length, m)
        out = self.one_call(ids, self.length, (cos[0, 0], sin[0, 0]), rows, states=output_hidden_states)
        if out is None:  # a token the embedding lacks: forward raises the error
            return None
        self.hidden_states = out[2]
        return (out[1],)

    @torch.inference_mode()
    def greedy_chain(self, first: int | torch.Tensor | None, n: int, vocab: int,
                     feed: torch.Tensor | None = None, min_confidence: float = 0.0,
                     stop_ids: Sequence[int] = ()) -> list[int] | None:
        """Feed ``first`` and the next ``n - 1`` greedy tokens, one at a time, in one C call
        (``Transformer.greedy_chain``): ``[first, t1, .., tn]``, the argmax of each step's
        logits over ids below ``vocab``; the cache then holds ``first .. t(n-1)``.
        ``first`` may be the logits whose argmax it is: read only when the chain runs
        (where it cannot, nothing is read, so a GPU is not waited for). With ``feed``
        (``first`` None): those tokens are fed first, as :meth:`extend` would, and ``first``
        is the argmax of their last logits; ``min_confidence`` ends the chain early
        (``Transformer.greedy_chain``), as ``stop_ids`` do at the first of them. None where
        that path cannot run here (nothing fed): step with :meth:`extend`."""
        if self.cache is None or self.static is not None:
            return None
        m = 0 if feed is None else feed.numel()
        tokens = self.model.greedy_chain(first, n, self.length + m, self.cache, vocab, feed, min_confidence, stop_ids)
        if tokens is not None:  # (a chain that ended early fed one token fewer than it holds)
            self.length += m + len(tokens) - 1
            self.hidden_states = {}
        return tokens

    @torch.inference_mode()
    def spec_rounds(self, sequence: torch.Tensor, length: int, chain: cpu_kernels.EagleChain | None,
                    drafter_state: tuple[int, int, int], features: torch.Tensor | None,
                    k: int, depth: int, ngram: tuple[int, int] | None, remaining: int, context: int, chunk: int,
                    stop_ids: Sequence[int], draft: tuple[tuple, int] | None = None,
                    policy: torch.Tensor | None = None, taps: Sequence[int] = ()) -> cpu_kernels.SpecRounds | None:
        """Greedy speculative rounds after ``sequence[:length]`` in one C call
        (``cpu_kernels.spec_rounds``: prompt lookup, else an EAGLE ``chain`` or a draft
        model's; this model verifies), the cache then holding what they kept. ``drafter_state``: the EAGLE
        drafter's ``fed``, ``known`` and ``offset`` positions; ``draft``: a draft model's
        chain instead (``cpu_kernels.chain_model``'s and its cache length); ``policy``: the
        drafter's ``--draft-stop`` state, updated in place (None: fixed); ``taps``: the layers
        whose states an EAGLE-3 drafter fuses before the final one's. None where it
        cannot run here (no one-call pass for this model and cache): decode round by round."""
        if self.cache is None or self.static is not None or not self.one_call or sequence.dtype != torch.int64:
            return None
        cos, sin = self.model._rope(0, length + chunk + k + 1)
        fed, known, offset = drafter_state
        out = cpu_kernels.spec_rounds(self.one_call, chain, (cos[0, 0], sin[0, 0]), sequence, length,
                                      self.length, fed, known, offset, features, k, depth, ngram, remaining, context,
                                      chunk, stop_ids, draft, policy, taps)
        self.length = out.cached
        self.hidden_states = {}
        return out

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def compact(self, length: int, keep: list[int]) -> None:
        if keep != list(range(len(keep))):
            # (a non-blocking copy: torch.tensor(..., device=cuda) would wait for the GPU)
            self.cache.move(torch.tensor(keep).to(self.device, non_blocking=True) + length, length)
        self.length = min(self.length, length + len(keep))


class HFCausalLM:
    """Any ``transformers`` causal LM, for architectures the native runtime lacks."""

    backend = "hf"

    def __init__(self, model, model_dir: Path | None = None) -> None:
        self.model = model.eval()
        self.model_dir = model_dir
        cfg = model.config
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.context_length = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", 2048)
        eos = getattr(model.generation_config, "eos_token_id", None) or cfg.eos_token_id
        self.eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.length = 0
        self.past = None
        self.hidden_states: dict[int, torch.Tensor] = {}

    def reset(self, max_len: int | None = None) -> None:
        from transformers import DynamicCache

        self.past = DynamicCache()
        self.length = 0

    @torch.inference_mode()
    def extend(
        self,
        tokens: torch.Tensor,
        logits: str | int = "all",
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
        start_layer: int = 0,
        output_hidden_states: Sequence[int] = (),
    ) -> torch.Tensor:
        if hidden is not None:
            raise ValueError(EARLY_EXIT_NEEDS_NATIVE)
        if output_hidden_states:
            raise ValueError(HIDDEN_STATES_NEED_NATIVE)
        if mask is not None or positions is not None:
            raise ValueError(TREES_NEED_NATIVE)
        if self.past is None:
            self.reset()
        keep = 0 if logits == "all" else (1 if isinstance(logits, str) else logits)  # 0 keeps all
        tokens = tokens.to(self.model.device, non_blocking=True)
        with attention_kernels(self.model.device):  # no per-length cuDNN plans (see there)
            out, self.past = forward_with_cache(self.model, tokens.view(1, -1), self.past, logits_to_keep=keep)
        self.length += tokens.shape[-1]
        return None if logits == "none" else out[0].float()

    def crop(self, length: int) -> None:
        if length < self.length:
            # A negative count means "drop this many" in transformers 4.x and 5.x alike.
            self.past.crop(length - self.length)
            self.length = length

    def compact(self, length: int, keep: list[int]) -> None:
        if keep != list(range(len(keep))):
            raise ValueError(TREES_NEED_NATIVE)
        self.crop(length + len(keep))


def load_hf_model(model_dir: Path, dtype: torch.dtype = torch.float32,
                  shared: dict[str, torch.Tensor] | None = None):
    """Load a checkpoint with ``transformers`` (safetensors or GGUF only, never remote code);
    ``shared``: the tensors a draft takes from its target (:mod:`.shared_embed`)."""
    from transformers import AutoModelForCausalLM

    if gguf.is_gguf(model_dir):
        return gguf.load_hf_model(model_dir, dtype)
    safetensors_files(model_dir)  # refuses pickle-only checkpoints before transformers sees them
    if shared is None and read_shared(model_dir) is not None:
        raise missing_target_error(model_dir)
    with quiet_missing_weights(shared is not None):
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, use_safetensors=True, trust_remote_code=False
        )
    if shared is not None:
        fill_hf(model, shared, dtype)
    return model


@contextmanager
def quiet_missing_weights(active: bool):
    """transformers warns that the embeddings a shared-embedding draft leaves out were
    initialised at random; they are filled from the target right after."""
    if not active:
        yield
        return
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def load_model(
    name_or_path: str | Path, backend: str = "auto", placement: Placement | None = None,
    head_vocab: torch.Tensor | None = None, shared: dict[str, torch.Tensor] | None = None,
) -> CausalLM:
    """Load a model for decoding.

    Args:
        name_or_path: an embedded or packaged model name, a local Hugging Face directory,
            a GGUF file or a hub id.
        backend: ``"native"``, ``"hf"`` or ``"auto"`` (native whenever it supports the
            checkpoint, transformers otherwise).
        placement: device and compute dtype (default: CPU, float32;
            :func:`~quickdraft.models.placement.resolve_placement` makes one from
            ``--device`` / ``--dtype``).
        head_vocab: token ids the LM head scores (a draft's vocabulary,
            :meth:`Transformer.restrict_head`); native runtime only, ignored by transformers.
        shared: the tensors a draft takes from its loaded target
            (:func:`.shared_embed.shared_tensors`).
    """
    if backend not in ("auto", "native", "hf"):
        raise ValueError(f"unknown backend {backend!r}; choose auto, native or hf")
    placement = placement or Placement()
    model_dir = resolve_model_dir(name_or_path)
    if backend in ("auto", "native"):
        try:
            model = load_native(model_dir, placement.dtype, placement.device, shared, placement.quantize)
            model.kv_dtype = placement.kv_dtype
            if head_vocab is not None:
                model.restrict_head(head_vocab)
            return NativeLM(model, model_dir)
        except UnsupportedModelError:
            if backend == "native":
                raise
    read_hf_config(model_dir)  # refuses remote-code models with a clear message
    if placement.quantize in ("int8", "int4"):
        raise CheckpointError(f"--quantize {placement.quantize} needs the native runtime; {model_dir.name} "
                              "runs on transformers (drop --quantize)")
    if placement.kv_dtype is not None:
        raise CheckpointError(f"--kv-cache {placement.kv_cache} needs the native runtime; {model_dir.name} "
                              "runs on transformers (drop --kv-cache)")
    try:
        return HFCausalLM(load_hf_model(model_dir, placement.dtype, shared).to(placement.device), model_dir)
    # RuntimeError: transformers' verdict on weights that do not fit the model it built
    # (a GGUF architecture whose tensors it maps differently, say).
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"transformers could not load {model_dir}: {str(exc).splitlines()[0]}") from None
