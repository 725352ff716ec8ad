"""The files of a head trained for one target (exit head, Medusa heads, prophet, EAGLE
drafter): ``config.json``, naming its kind and its target's fingerprint, and
``model.safetensors``. One layout and one set of checks for every kind, so each kind's
module only says what its config holds and how its weights become a module.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TypeVar

import torch

from .errors import CheckpointError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

C = TypeVar("C")


@dataclass(frozen=True)
class HeadFiles:
    """How one kind of head is stored, and how messages name it."""

    kind: str  # the ``kind`` its config.json holds
    what: str  # its name in messages: "EAGLE drafter"
    train: str  # the command that trains one, for the fix in a message

    def is_dir(self, path: str | Path) -> bool:
        """Whether ``path`` holds a head of this kind."""
        config = Path(path) / CONFIG_FILE
        try:
            return config.is_file() and json.loads(config.read_text()).get("kind") == self.kind
        except (OSError, ValueError):
            return False

    def read_config(self, path: str | Path, cls: type[C]) -> C:
        """``path``'s config as ``cls`` (unknown keys ignored: newer files load); a one-line
        CheckpointError when ``path`` holds no head of this kind."""
        path = Path(path)
        if not self.is_dir(path):
            raise CheckpointError(f"{path} holds no {self.what} ({CONFIG_FILE} of kind {self.kind}); train one "
                                  f"with `{self.train}`")
        values = json.loads((path / CONFIG_FILE).read_text())
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})

    def check_target(self, path: str | Path, config, fits: bool, fingerprint: str) -> None:
        """Refuse a head trained on another target: ``fits`` says whether its sizes match
        the target's, ``fingerprint`` is the target's (an empty recorded one is not checked)."""
        recorded = getattr(config, "target_fingerprint", "")
        if not fits or (recorded and recorded != fingerprint):
            raise CheckpointError(f"{self.what} {path} was trained on another target "
                                  f"({getattr(config, 'target', '') or 'unnamed'}); train one for this target "
                                  f"with `{self.train}`")

    def read_weights(self, path: str | Path) -> dict[str, torch.Tensor]:
        """The head's tensors; a one-line CheckpointError when the file cannot be read."""
        from safetensors.torch import load_file

        file = Path(path) / WEIGHTS_FILE
        try:
            return load_file(str(file))
        except (OSError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"cannot read {self.what} {file}: {str(exc).splitlines()[0][:160]}") from None

    def save(self, out: str | Path, config, tensors: dict[str, torch.Tensor],
             dtype: torch.dtype = torch.bfloat16) -> None:
        """Write ``config`` (a dataclass) and ``tensors`` (floating ones as ``dtype``,
        integer ones as they are) to ``out``, readable by everyone. bf16 by default, as the
        drafts are: half the bytes to ship, and loading casts them to the target's dtype
        (a draft's rounding costs acceptance at most, never exactness)."""
        from safetensors.torch import save_file

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        stored = {k: (v.to(dtype) if v.is_floating_point() else v).detach().contiguous() for k, v in tensors.items()}
        save_file(stored, str(out / WEIGHTS_FILE))
        (out / CONFIG_FILE).write_text(json.dumps(asdict(config), indent=2) + "\n")
        for f in (out / WEIGHTS_FILE, out / CONFIG_FILE):
            f.chmod(0o644)  # safetensors may create 0600 files; ship them readable

    def trained_for(self, directory: Path, fingerprint: str, cls: type) -> list[Path]:
        """The heads of this kind in ``directory`` trained on the target of ``fingerprint``."""
        if not directory.is_dir():
            return []
        return [path for path in sorted(directory.iterdir())
                if self.is_dir(path) and self.read_config(path, cls).target_fingerprint == fingerprint]
