"""The prophet transformer (issue 25, from the lucidrains scratchpad): a small causal
decoder whose first ``n_start`` inputs are the target's final hidden states (before the
norm) of the last ``n_start`` positions it has accepted, mapped to the prophet's width
(identity, or a bias-free linear map), followed by its own token embeddings.

A prophet sequence ``[h_{t-n+1} .. h_t, x_{t+1}, x_{t+2}, ...]`` sits at positions
``0, 1, 2, ...`` (each drafting round starts a fresh one), and its output at every
position predicts the text's next token: at ``h_j`` the token ``x_{j+1}``, at ``x_j`` the
token ``x_{j+1}``. Drafting feeds the newest token ``x_{t+1}`` after the states and reads
its drafts off the outputs from there on.

The decoder is the native :class:`~.transformer.Transformer` (Llama blocks, RoPE, its
own embeddings and tied LM head), so drafting runs on the same decode kernels as a
draft model, and like a draft's its LM head scores only the most frequent tokens when its
directory has a ``draft_vocab.json``. Saved as ``config.json`` + ``model.safetensors``
with the fingerprint of the target it reads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from .config import ModelConfig
from .draft_vocab import read_draft_vocab
from .exit_head import target_fingerprint
from .head_files import HeadFiles
from .kv_cache import TrainingKVCache
from .loading import CheckpointError
from .transformer import Transformer

PROPHET_KIND = "quickdraft-prophet"


@dataclass
class ProphetConfig:
    """What a saved prophet is, and the target it reads."""

    target_hidden_size: int
    vocab_size: int
    hidden_size: int
    n_layers: int = 1
    n_heads: int = 4
    intermediate_size: int = 0  # 0: 8/3 of the width, rounded up to 64
    n_start: int = 1  # target states fed first
    gamma: int = 4  # tokens drafted per round in training (windows of gamma + 2 tokens)
    project: bool = False  # a bias-free linear map of the states (required when widths differ)
    max_positions: int = 64  # n_start + the deepest draft
    target: str = ""
    target_fingerprint: str = ""
    kind: str = PROPHET_KIND

    def __post_init__(self) -> None:
        if self.n_start < 1 or self.gamma < 1 or self.n_layers < 1:
            raise ValueError("a prophet needs n_start, gamma and n_layers >= 1")
        if self.hidden_size % self.n_heads:
            raise ValueError(f"prophet width {self.hidden_size} is not a multiple of its {self.n_heads} heads")
        if not self.project and self.hidden_size != self.target_hidden_size:
            raise ValueError(f"the prophet's width {self.hidden_size} differs from the target's "
                             f"{self.target_hidden_size}: it needs the linear map (project=True)")
        if not self.intermediate_size:
            self.intermediate_size = -(-self.hidden_size * 8 // 3 // 64) * 64

    def decoder_config(self) -> ModelConfig:
        return ModelConfig(family="llama", model_type="llama", vocab_size=self.vocab_size,
                           hidden_size=self.hidden_size, n_layers=self.n_layers, n_heads=self.n_heads,
                           n_kv_heads=self.n_heads, head_dim=self.hidden_size // self.n_heads,
                           intermediate_size=self.intermediate_size, max_position_embeddings=self.max_positions,
                           tie_word_embeddings=True)


class Prophet(nn.Module):
    """The start-state map and the decoder."""

    def __init__(self, config: ProphetConfig) -> None:
        super().__init__()
        self.config = config
        h_t, h = config.target_hidden_size, config.hidden_size
        # The identity where widths match; never a norm here (the source found one hurt).
        self.start = nn.Linear(h_t, h, bias=False) if config.project else nn.Identity()
        self.decoder = Transformer(config.decoder_config())

    def inputs(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The decoder's input stream ``[B, n + T, H]``: the mapped target states
        ``[B, n, H_t]``, then the embeddings of ``tokens`` ``[B, T]``."""
        return torch.cat([self.start(states), self.decoder.embed(tokens)], dim=1)

    def forward(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, n + T, V]`` of whole prophet sequences, from scratch (training, and
        the reference incremental drafting must equal): positions ``0 .. n + T - 1``."""
        x = self.inputs(states, tokens)
        cache = TrainingKVCache(self.decoder.config, x.shape[0], x.shape[1], x.dtype, x.device)
        return self.decoder(None, 0, cache, hidden=x).logits

    def init_from_target(self, target: Transformer) -> None:
        """Start from the target's embeddings (so its tied LM head too), final norm and
        last blocks, where the shapes allow: what the prophet must learn is close to the
        target's own next-token map, so this is a better first guess than noise."""
        dec = self.decoder
        with torch.no_grad():
            if target.embed.weight.shape == dec.embed.weight.shape:
                dec.embed.weight.copy_(target.embed.weight)
                dec.norm.load_state_dict(target.norm.state_dict())
            for mine, theirs in zip(reversed(dec.layers), reversed(target.layers)):
                try:
                    mine.load_state_dict(theirs.state_dict())
                except RuntimeError:  # another width or head count
                    break


FILES = HeadFiles(PROPHET_KIND, "prophet", "quickdraft train heads --kind prophet --target ...")


def is_prophet_dir(path: str | Path) -> bool:
    return FILES.is_dir(path)


def save_prophet(prophet: Prophet, target: Transformer, target_name: str, out: str | Path) -> None:
    """Write ``config.json`` + ``model.safetensors`` (fp32; the tied LM head stored once)."""
    cfg = ProphetConfig(**{**asdict(prophet.config), "target": target_name,
                           "target_fingerprint": target_fingerprint(target)})
    FILES.save(out, cfg, {k: v for k, v in prophet.state_dict().items() if k != "decoder.lm_head.weight"})


def read_prophet_config(path: str | Path) -> ProphetConfig:
    """The config of the prophet in ``path``; a one-line CheckpointError when there is none."""
    return FILES.read_config(path, ProphetConfig)


def load_prophet(path: str | Path, target: Transformer, draft_vocab: int | None = None) -> Prophet:
    """The prophet in ``path`` for ``target`` (eval, frozen, the target's device and dtype);
    a one-line CheckpointError when it is none or was trained on another target.
    ``draft_vocab``: how many of the most frequent tokens (its ``draft_vocab.json``) it
    scores when drafting: None its default, 0 all."""
    cfg = read_prophet_config(path)
    tc = target.config
    FILES.check_target(path, cfg, (cfg.target_hidden_size, cfg.vocab_size) == (tc.hidden_size, tc.vocab_size),
                       target_fingerprint(target))
    ids = read_draft_vocab(path, draft_vocab)
    prophet = Prophet(cfg)
    try:
        result = prophet.load_state_dict(FILES.read_weights(path), strict=False)
        # The tied LM head is the embedding, stored once; anything else missing is an error.
        if set(result.missing_keys) - {"decoder.lm_head.weight"} or result.unexpected_keys:
            raise RuntimeError(f"weights do not match the config: missing {result.missing_keys}, "
                               f"unexpected {result.unexpected_keys}")
    except RuntimeError as exc:
        raise CheckpointError(f"cannot read prophet {path}: {str(exc).splitlines()[0]}") from None
    weight = target.embed.weight
    prophet = prophet.to(device=weight.device, dtype=weight.dtype).eval().requires_grad_(False)
    if ids is not None:  # score only the frequent tokens when drafting: cheaper, same output
        prophet.decoder.restrict_head(ids.to(weight.device))
    return prophet
