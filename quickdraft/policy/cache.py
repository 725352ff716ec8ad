"""The on-disk cache of measured policy choices, keyed by what determined the measurement.

Three measurements are cached as JSON files under ``$XDG_CACHE_HOME/quickdraft/autok/``
(default ``~/.cache/quickdraft/autok/``): the auto-k choice (``k-*.json``,
:mod:`.autok`), the ``--method auto`` choice (``method-*.json``, :mod:`.method_choice`)
and the batch policy's cost tables (``batch-*.json``, :mod:`.batch_policy`).

An entry's name is a digest of its *identity*: the kind of measurement, the caller's
settings, the machine (:func:`machine_fingerprint`: CPU, cores, torch threads and version,
linear kernels) and the models (:func:`model_fingerprint`). The identity is written into the file with
the data.

This module is the only place that computes fingerprints, names cache files and reads and
writes them (atomically: a reader never sees half a file).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

#: Bumped when the fingerprints change meaning (every entry is then measured again).
FINGERPRINT_VERSION = 1


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/quickdraft``, by default ``~/.cache/quickdraft``."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "quickdraft"


def cache_dir() -> Path:
    """Where measured choices are cached: ``$XDG_CACHE_HOME/quickdraft/autok``."""
    return cache_root() / "autok"


def digest(value) -> str:
    """A short stable digest of a JSON-able value (dict keys sorted)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:20]


def write_json(path: Path, data) -> None:
    """Write ``data`` as JSON to ``path`` atomically (a temporary file, then a rename);
    raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_json(path: Path):
    """The JSON in ``path``, or None when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# --- fingerprints ---------------------------------------------------------------------------

def model_fingerprint(lm) -> dict | None:
    """What identifies a loaded model: its directory, backend and the size and modification
    time of its config and weight files (None when it has no directory)."""
    model_dir = getattr(lm, "model_dir", None)
    if model_dir is None:
        return None
    model_dir = Path(model_dir).resolve()
    files = sorted(p for p in model_dir.iterdir() if p.name == "config.json" or p.suffix == ".safetensors")
    head_ids = getattr(getattr(lm, "model", None), "head_ids", None)
    return {
        "path": str(model_dir),
        "backend": lm.backend,
        "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files],
        # A draft's restricted head (draft_vocab.json) changes its step cost and acceptance.
        "head_vocab": None if head_ids is None else int(head_ids.numel()),
    }


def machine_fingerprint() -> dict:
    """What identifies the machine: CPU, cores, torch threads and version, and the linear
    kernels the native runtime decodes with (costs change with them)."""
    from ..machine import cpu_model
    from ..models.decode_linear import SMALL_WEIGHT_ELEMENTS, onednn_linear_available

    return {
        "cpu": cpu_model(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        # The drafts' one-row MKL products changed step costs: part of the key.
        "linear_kernels": f"onednn,mkl-rows1<={SMALL_WEIGHT_ELEMENTS}" if onednn_linear_available() else "torch",
    }


# --- entries --------------------------------------------------------------------------------


@dataclass
class Entry:
    """One cached measurement: where it lives and the identity it is keyed by."""

    path: Path
    identity: dict

    def load(self) -> dict | None:
        """The cached data (identity included), or None when missing or unreadable."""
        data = read_json(self.path)
        return data if isinstance(data, dict) else None

    def store(self, data: Mapping) -> None:
        """Write the identity and ``data`` (atomically); raises OSError."""
        write_json(self.path, {**self.identity, **data})


def entry(kind: str, version: int, models: Mapping[str, object], **settings) -> Entry | None:
    """The cache entry of a ``kind`` of measurement (``"k"``, ``"method"``, ``"batch"``)
    of ``models`` on this machine with ``settings`` (JSON-able). ``models`` maps a role
    (``"target"``, ``"draft"``) to a loaded model (fingerprinted by content) or to a plain
    label (a string or None: a drafter without a model of its own). None when a model
    cannot be fingerprinted (no directory): such a measurement is not cached."""
    prints: dict[str, object] = {}
    for role, model in models.items():
        if model is None or isinstance(model, str):
            prints[role] = model
            continue
        fingerprint = model_fingerprint(model)
        if fingerprint is None:
            return None
        prints[role] = fingerprint
    identity = {"kind": kind, "version": version, "fingerprint_version": FINGERPRINT_VERSION,
                **settings, "machine": machine_fingerprint(), **prints}
    return Entry(cache_dir() / f"{kind}-{digest(identity)}.json", identity)
