"""Exit heads: turn the residual stream after the target's layer L into next-token logits.

An early-exit draft is the target's own layers ``[0, L)`` plus one of these heads:

* the **shared** head: the target's final norm + LM head, nothing trained (the "logit
  lens");
* a **trained** head: an affine translator ``h + A h + b`` (A zero-initialised) and its
  own final norm in front of the target's LM head, as the tuned lens (Belrose et al.
  2023) does; only ``hidden_size^2`` parameters, and the LM head stays shared;
* the same with an **extra transformer block** first (lucidrains' "extra transformer
  block head"), initialised from the target's layer L. Its keys and values live in a
  cache of its own (one layer).

A trained head is a small directory: ``config.json`` (:class:`ExitHeadConfig`, with the
target's name and fingerprint), ``model.safetensors`` (the head's weights only), a model
card and the training log. :func:`load_exit_head` refuses a head made for another target.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .config import ModelConfig
from .decode_linear import PackedWeightsError
from .draft_vocab import read_draft_vocab, spread_logits
from .head_files import HeadFiles
from .kv_cache import KVCache
from .loading import CheckpointError
from .quant_linear import QUANT_LINEARS, drafter_int8, native_kernels
from .transformer import Block, RaggedRow, Transformer, make_norm

HEAD_KIND = "quickdraft-exit-head"


@dataclass
class ExitHeadConfig:
    """What a saved head is: its layer, its parts and the target it was trained on."""

    exit_layer: int
    hidden_size: int
    vocab_size: int
    extra_block: bool = False
    target: str = ""  # the target's name (embedded name or directory name)
    target_fingerprint: str = ""  # :func:`target_fingerprint` of the target it was trained on
    kind: str = HEAD_KIND
    # The head early exit uses for this target when none is named: set by hand on the
    # shipped head the cost model picked (docs/bench/exit_heads.py), False from training.
    default: bool = False

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def target_fingerprint(model: Transformer) -> str:
    """A short content hash of a target: its shape and a few of its weights (embedding rows
    and norms, which the CPU decode kernels leave in place), so the same weights give the
    same fingerprint wherever they are stored. The weights are hashed rounded to bfloat16,
    so the target loaded ``--dtype bfloat16`` keeps its heads (for a bfloat16 checkpoint,
    such as the embedded models, the rounding changes nothing)."""
    cfg = model.config
    h = hashlib.sha256(json.dumps([cfg.family, cfg.n_layers, cfg.hidden_size, cfg.vocab_size]).encode())
    with torch.no_grad():
        for t in (model.embed.weight[:8], model.embed.weight[-8:], model.norm.weight,
                  model.layers[-1].mlp_norm.weight):
            h.update(t.detach().to(torch.bfloat16).to(torch.float32).cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class ExitHead(nn.Module):
    """Logits from the residual stream after layer ``exit_layer`` of ``target``.

    ``trained=False`` is the shared head (no parameters of its own). Otherwise the head
    has a translator (zero-initialised: it starts as the shared head) and its own norm,
    and with ``extra_block`` a transformer block with a one-layer KV cache in front.
    """

    def __init__(self, config: ModelConfig, exit_layer: int, trained: bool = True, extra_block: bool = False) -> None:
        super().__init__()
        if extra_block and not trained:
            raise ValueError("an extra block head is a trained head")
        self.exit_layer = exit_layer
        self.trained = trained
        self.block = Block(config) if extra_block else None
        self.norm = make_norm(config) if trained else None
        self.translator = nn.Linear(config.hidden_size, config.hidden_size) if trained else None
        self.block_config = dataclasses.replace(config, n_layers=1)
        # --draft-vocab: the tokens draft steps score (draft_vocab.json; None: all), and
        # their LM head rows once restrict_vocab has copied them (a drafting copy only).
        self.draft_ids: torch.Tensor | None = None
        self.vocab_head: nn.Module | None = None

    @property
    def kind(self) -> str:
        return "extra-block" if self.block is not None else "trained" if self.trained else "shared"

    def init_from(self, target: Transformer) -> ExitHead:
        """Start as the shared head: the target's final norm, a zero translator and, for the
        extra block, a copy of the target's layer ``exit_layer`` (what would run next)."""
        with torch.no_grad():
            if self.norm is not None:
                self.norm.load_state_dict(target.norm.state_dict())
            if self.translator is not None:
                self.translator.weight.zero_()
                self.translator.bias.zero_()
            if self.block is not None:
                source = target.layers[min(self.exit_layer, target.config.n_layers - 1)]
                self.block.load_state_dict(source.state_dict())
        return self

    def new_cache(self, batch_size: int, max_len: int, like: torch.Tensor) -> KVCache | None:
        """The extra block's KV cache (None without one)."""
        if self.block is None:
            return None
        return KVCache(self.block_config, batch_size, max_len, dtype=like.dtype, device=like.device)

    def transform(self, hidden: torch.Tensor, target: Transformer, positions: torch.Tensor | int,
                  cache: KVCache | None, slots: torch.Tensor | int | None = None,
                  ragged: Sequence[RaggedRow] | None = None) -> torch.Tensor:
        """The head's residual stream (``[B, T, H]``) before its norm; the extra block
        writes its keys and values for ``positions`` (``[B, T]`` or an int, as in
        ``Transformer.forward``) to ``cache`` at ``slots``
        (default: the positions), row by row for a ``ragged`` batch (as ``Transformer.forward``)."""
        x = hidden
        if self.block is not None:
            slots = positions if slots is None else slots
            if ragged is None:
                rope, rows, mask, kv_len = target.attention_inputs(positions, cache, slots, shape=x.shape[:2])
                x = self.block(x, rope, cache, 0, rows, slots, mask, kv_len)
            else:
                rope, row_masks, kv_len = target.ragged_inputs(positions, cache, ragged)
                x = self.block(x, rope, cache, 0, None, slots, None, kv_len, ragged=row_masks)
        if self.translator is not None:
            x = x + self.translator(x)
        return x

    def logits(self, x: torch.Tensor, target: Transformer) -> torch.Tensor:
        """Logits of :meth:`transform`'s output with the target's LM head (after
        :meth:`restrict_vocab`, its rows for :attr:`draft_ids`; ``-inf`` elsewhere)."""
        h = (self.norm or target.norm)(x)
        if self.vocab_head is None:
            return target.lm_head(h)
        return spread_logits(self.vocab_head(h), self.draft_ids, target.config.vocab_size)

    def restrict_vocab(self, target: Transformer) -> None:
        """Score only :attr:`draft_ids` from now on, through a copy of the target's LM head
        rows for them: an early-exit draft step otherwise pays the whole LM head (on
        SmolLM2 a fifth of a target step, 49,152 x 576). Only what is proposed can change,
        never what the target accepts; sampled proposals give the other tokens probability
        zero, which the exact acceptance rule allows for. Beside a quantized LM head the
        rows are int8 (a drafter's, ``quant_linear.drafter_int8``), else the target's dtype.
        Where only oneDNN's packed form holds the head's weights (no C compiler), the steps
        go on scoring the whole vocabulary."""
        try:
            rows = target.head_rows(self.draft_ids)
        except PackedWeightsError:
            self.draft_ids = None
            return
        self.draft_ids = self.draft_ids.to(rows.device)
        if isinstance(target.lm_head, QUANT_LINEARS) and native_kernels() and rows.device.type == "cpu":
            self.vocab_head = drafter_int8(rows.float().contiguous())
        else:
            self.vocab_head = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device,
                                        dtype=target.embed.weight.dtype).requires_grad_(False)
            self.vocab_head.weight.data.copy_(rows)

    def config_for(self, target: Transformer, target_name: str) -> ExitHeadConfig:
        cfg = target.config
        return ExitHeadConfig(self.exit_layer, cfg.hidden_size, cfg.vocab_size, self.block is not None,
                              target_name, target_fingerprint(target))


FILES = HeadFiles(HEAD_KIND, "exit head", "quickdraft train exit-head --target ...")


def save_exit_head(head: ExitHead, target: Transformer, target_name: str, out: Path) -> None:
    """``config.json`` + ``model.safetensors`` (the head's own weights, bf16) in ``out``."""
    FILES.save(out, head.config_for(target, target_name), head.state_dict())


def is_exit_head_dir(path: str | Path) -> bool:
    return FILES.is_dir(path)


def read_head_config(path: str | Path) -> ExitHeadConfig:
    return FILES.read_config(path, ExitHeadConfig)


def load_exit_head(path: str | Path, target: Transformer, draft_vocab: int | None = None) -> ExitHead:
    """A trained head for ``target``; a one-line CheckpointError when it was made for
    another target (vocabulary, width, depth or weights differ). ``draft_vocab``: how many
    of the most frequent tokens (its ``draft_vocab.json``) its draft steps score, as
    :attr:`ExitHead.draft_ids`: None its default, 0 all (a ValueError for a number it
    cannot give)."""
    cfg = read_head_config(path)
    tc = target.config
    if (cfg.hidden_size, cfg.vocab_size) != (tc.hidden_size, tc.vocab_size):
        raise CheckpointError(
            f"exit head {path} was trained for a target with hidden size {cfg.hidden_size} and vocabulary "
            f"{cfg.vocab_size}, not this one ({tc.hidden_size}, {tc.vocab_size}); train one for it with "
            "`quickdraft train exit-head --target ...`")
    if not 1 <= cfg.exit_layer < tc.n_layers:
        raise CheckpointError(f"exit head {path} exits after layer {cfg.exit_layer}, but the target has "
                              f"{tc.n_layers} layers; train one for this target")
    FILES.check_target(path, cfg, True, target_fingerprint(target))
    ids = read_draft_vocab(path, draft_vocab)
    head = ExitHead(tc, cfg.exit_layer, trained=True, extra_block=cfg.extra_block)
    head.draft_ids = ids
    try:
        head.load_state_dict({k: v.to(target.embed.weight.dtype) for k, v in FILES.read_weights(path).items()})
    except RuntimeError as exc:
        raise CheckpointError(f"cannot load the exit head in {path}: {str(exc).splitlines()[0][:160]}") from None
    return head.to(target.embed.weight.device).eval().requires_grad_(False)
