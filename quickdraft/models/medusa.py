"""Medusa heads (Cai et al. 2024): K small heads on the target's final hidden state, head
``i`` predicting the token ``i + 2`` places after the state's own (the target's LM head
predicts the next one).

Each head is one residual block, ``x + SiLU(W x)``, followed by the target's own final norm
and LM head (shared and frozen, so a head adds ``H * H`` weights, not ``H * V``). ``W``
starts at zero: an untrained head is the target's LM head on the same state, a
reasonable first guess that training improves. Saved as ``config.json`` +
``model.safetensors``, with the fingerprint of the target they were trained on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .exit_head import target_fingerprint
from .head_files import HeadFiles
from .loading import CheckpointError
from .transformer import Transformer

MEDUSA_KIND = "quickdraft-medusa-heads"


@dataclass
class MedusaConfig:
    """What a saved set of heads is, and the target it reads."""

    num_heads: int
    hidden_size: int
    vocab_size: int
    target: str = ""
    target_fingerprint: str = ""
    kind: str = MEDUSA_KIND


class ResBlock(nn.Module):
    """``x + SiLU(W x)``, with ``W`` zero at first (the block starts as the identity)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.proj(x))


class MedusaHeads(nn.Module):
    """``num_heads`` residual blocks read by the target's final norm + LM head."""

    def __init__(self, num_heads: int, hidden_size: int) -> None:
        super().__init__()
        if num_heads < 1:
            raise ValueError(f"Medusa needs at least one head, got {num_heads}")
        self.blocks = nn.ModuleList(ResBlock(hidden_size) for _ in range(num_heads))

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def head_logits(self, i: int, hidden: torch.Tensor, target: Transformer) -> torch.Tensor:
        """Head ``i``'s logits (``[..., V]``) from the target's final states ``hidden``."""
        return target.head(self.blocks[i](hidden))

    def forward(self, hidden: torch.Tensor, target: Transformer) -> torch.Tensor:
        """Every head's logits, ``[num_heads, ..., V]``."""
        return torch.stack([self.head_logits(i, hidden, target) for i in range(self.num_heads)])


FILES = HeadFiles(MEDUSA_KIND, "Medusa heads", "quickdraft train heads --kind medusa --target ...")


def is_medusa_dir(path: str | Path) -> bool:
    return FILES.is_dir(path)


def save_medusa(heads: MedusaHeads, target: Transformer, target_name: str, out: str | Path) -> None:
    """Write ``config.json`` + ``model.safetensors`` (the heads' own weights, fp32) to ``out``."""
    cfg = MedusaConfig(heads.num_heads, target.config.hidden_size, target.config.vocab_size, target_name,
                       target_fingerprint(target))
    FILES.save(out, cfg, heads.state_dict())


def read_medusa_config(path: str | Path) -> MedusaConfig:
    """The config of the heads in ``path``; a one-line CheckpointError when there are none."""
    return FILES.read_config(path, MedusaConfig)


def load_medusa(path: str | Path, target: Transformer) -> MedusaHeads:
    """Heads trained for ``target``; a one-line CheckpointError when they are not Medusa
    heads or were trained on another target."""
    cfg = read_medusa_config(path)
    tc = target.config
    FILES.check_target(path, cfg, (cfg.hidden_size, cfg.vocab_size) == (tc.hidden_size, tc.vocab_size),
                       target_fingerprint(target))
    heads = MedusaHeads(cfg.num_heads, cfg.hidden_size)
    try:
        heads.load_state_dict(FILES.read_weights(path))
    except RuntimeError as exc:
        raise CheckpointError(f"cannot read Medusa heads {path}: {str(exc).splitlines()[0]}") from None
    weight = target.embed.weight
    return heads.to(device=weight.device, dtype=weight.dtype).eval().requires_grad_(False)
