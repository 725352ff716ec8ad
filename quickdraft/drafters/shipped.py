"""Heads shipped with the package (``assets/heads``, one directory each), found for a
target by its fingerprint: what ``--method early-exit|medusa|prophet|eagle`` load when no
``--heads`` names one."""

from __future__ import annotations

from pathlib import Path

from ..models.exit_head import target_fingerprint
from ..models.head_files import HeadFiles
from ..models.lm import CausalLM, NativeLM

HEADS_DIR = Path(__file__).resolve().parent.parent / "assets" / "heads"


def shipped_for(target: CausalLM, files: HeadFiles, config_cls: type) -> list[Path]:
    """The packaged heads of ``files``' kind trained on ``target``, by name."""
    if not isinstance(target, NativeLM):
        return []
    return files.trained_for(HEADS_DIR, target_fingerprint(target.model), config_cls)
