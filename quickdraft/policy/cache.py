"""The on-disk cache of measured policy choices, keyed by what determined the measurement.

Three measurements are cached as JSON files under ``$XDG_CACHE_HOME/quickdraft/autok/``
(default ``~/.cache/quickdraft/autok/``): the auto-k choice (``k-*.json``,
:mod:`.autok`), the ``--method auto`` choice (``method-*.json``, :mod:`.method_choice`)
and the batch policy's cost tables (``batch-*.json``, :mod:`.batch_policy`).

An entry's name is a digest of its *identity*: the kind of measurement, the caller's
settings, the machine (:func:`machine_fingerprint`: CPU, cores, torch threads and version,
linear kernels) and the models (:func:`model_fingerprint`: the content of their weights,
config, dtype, backend and kernels, never their paths, so an editable and a pip install of
the same pair share one entry). The identity is written into the file with the data.

This module is the only place that computes fingerprints, names cache files and reads and
writes them (atomically: a reader never sees half a file).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

#: Bumped when the fingerprints change meaning (every entry is then measured again).
FINGERPRINT_VERSION = 2  # 2: model content instead of its path, size and mtime


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


def module_digest(module: torch.nn.Module, *extra) -> str:
    """A content hash of a small module (a head): its state dict's names and values, and
    ``extra`` (JSON-able: what else decides how it drafts)."""
    sha = hashlib.sha256(json.dumps(extra, default=str).encode())
    for name, tensor in module.state_dict().items():
        sha.update(name.encode())
        sha.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()[:16]


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

_HUB_BLOB = re.compile(r"[0-9a-f]{64}")


def file_digest(path: Path) -> str:
    """The sha256 of a file's content.

    A Hugging Face hub download is a symlink to a blob named by it (read, not computed).
    Otherwise the file is hashed once and the digest remembered under
    ``cache_root()/digests``, keyed by the file's resolved path, size, mtime and inode."""
    resolved = Path(path).resolve()
    if resolved.parent.name == "blobs" and _HUB_BLOB.fullmatch(resolved.name):
        return resolved.name
    stat = resolved.stat()
    stamp = {"path": str(resolved), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}
    memo = cache_root() / "digests" / f"{digest(str(resolved))}.json"
    known = read_json(memo)
    if isinstance(known, dict) and known.get("stamp") == stamp and isinstance(known.get("sha256"), str):
        return known["sha256"]
    sha = hashlib.sha256()
    with open(resolved, "rb") as f:
        while chunk := f.read(1 << 22):
            sha.update(chunk)
    value = sha.hexdigest()
    try:
        write_json(memo, {"stamp": stamp, "sha256": value})
    except OSError:
        pass  # hashed again next time
    return value


def _config_digest(path: Path) -> str:
    """config.json's content without the fields that name where it was saved from."""
    config = json.loads(path.read_text())
    if isinstance(config, dict):
        config = {k: v for k, v in config.items() if k not in ("_name_or_path", "transformers_version")}
    return digest(config)


def model_fingerprint(lm) -> dict | None:
    """What determines a loaded model's step costs and acceptance, independent of where it
    is installed: the content of its weight files and config, its backend, dtype, whether
    the native decode kernels run it, its EOS ids and a draft's restricted head
    (draft_vocab.json). None when it has no directory or its files cannot be read."""
    from ..models.gguf import is_gguf
    from ..models.loading import CheckpointError, safetensors_files
    from ..models.quant_linear import QUANT_LINEARS

    model_dir = getattr(lm, "model_dir", None)
    if model_dir is None:
        return None
    model_dir = Path(model_dir)
    try:
        if is_gguf(model_dir):  # one file holds the weights and the configuration
            weights, config = [[model_dir.name, file_digest(model_dir)]], None
        else:
            weights = [[p.name, file_digest(p)] for p in safetensors_files(model_dir)]
            config = _config_digest(model_dir / "config.json")
    except (OSError, ValueError, CheckpointError):
        return None
    module = getattr(lm, "model", None)
    param = next(module.parameters(), None) if isinstance(module, torch.nn.Module) else None
    head_ids = getattr(module, "head_ids", None)
    # Quantized linears change step costs (listed only when present: old keys stay valid).
    quantized = sorted({type(m).__name__ for m in module.modules() if isinstance(m, QUANT_LINEARS)}
                       ) if isinstance(module, torch.nn.Module) else []
    return {
        "weights": weights,
        "config": config,
        "backend": lm.backend,
        "dtype": None if param is None else str(param.dtype),
        "decode_kernels": bool(getattr(lm, "decode_linears", False)),
        "eos": [int(t) for t in getattr(lm, "eos_token_ids", [])],
        # A draft's restricted head changes its step cost and acceptance.
        "head": None if head_ids is None else hashlib.sha256(
            head_ids.detach().cpu().to(torch.int64).numpy().tobytes()).hexdigest()[:20],
        **({"quantized": quantized} if quantized else {}),
        # A 16-bit KV cache changes long-context step costs (listed only when set, as above).
        **({"kv_cache": str(module.kv_dtype)} if getattr(module, "kv_dtype", None) is not None else {}),
    }


def machine_fingerprint() -> dict:
    """What identifies the machine: CPU, cores, torch threads and version, and the linear
    and compiled kernels the native runtime decodes with (costs change with them)."""
    from ..machine import cpu_model
    from ..models import cpu_kernels
    from ..models.decode_linear import SMALL_WEIGHT_ELEMENTS, onednn_linear_available

    return {
        "cpu": cpu_model(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        # The drafts' one-row MKL products changed step costs: part of the key.
        "linear_kernels": f"onednn,mkl-rows1<={SMALL_WEIGHT_ELEMENTS}" if onednn_linear_available() else "torch",
        # Our compiled kernels (a new version, or the AVX2 / AVX-512 path, moves every cost).
        "native_kernels": cpu_kernels.fingerprint(),
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


def measured_once(entry: Entry | None, what: str, measure: Callable[[], dict], valid: Callable[[dict], bool],
                  remeasure: bool = False, log: Callable[[str], None] | None = None) -> tuple[dict, bool]:
    """A measurement kept in the cache: ``entry``'s data where it holds one that is ``valid``
    (and not ``remeasure``), else ``measure()``'s, stamped and stored there; and whether it
    was measured now. ``what`` names it in the lines ``log`` gets (before a measurement, and
    when the cache cannot be written)."""
    log = log or (lambda msg: None)
    if entry is not None and not remeasure:
        data = entry.load()
        if data is not None and valid(data):
            return data, False
    log(f"measuring {what} on this machine, once "
        f"({f'cached in {entry.path}' if entry is not None else 'not cached'}; --remeasure redoes it)")
    data = {**measure(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if entry is not None:
        try:
            entry.store(data)
        except OSError as exc:
            log(f"could not write the cache ({exc.strerror or exc}); {what} is not cached")
    return data, True
