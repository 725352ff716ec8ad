"""The embedded model family: models shipped inside the package, addressable by short name.

Each model lives in ``quickdraft/assets/models/<name>/`` as a Hugging Face directory
(``config.json``, ``model.safetensors``, tokenizer files, ``README.md`` model card) plus a
``quickdraft.json`` with registry metadata::

    {"name": "qd-stdlib-target", "role": "target", "default": true,
     "draft": "qd-stdlib-draft", "params": 24000000, "description": "..."}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets" / "models"
META_FILE = "quickdraft.json"


@dataclass(frozen=True)
class EmbeddedModel:
    """One model shipped with quickdraft."""

    name: str
    path: Path
    role: str
    params: int
    default: bool = False
    draft: str | None = None
    description: str = ""

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "path": str(self.path),
            "role": self.role,
            "params": self.params,
            "default": self.default,
            "draft": self.draft,
            "description": self.description,
        }


def list_models(assets_dir: Path = ASSETS_DIR) -> list[EmbeddedModel]:
    """All embedded models, targets first, then by name."""
    models = []
    if assets_dir.is_dir():
        for meta_path in sorted(assets_dir.glob(f"*/{META_FILE}")):
            meta = json.loads(meta_path.read_text())
            models.append(
                EmbeddedModel(
                    name=meta["name"],
                    path=meta_path.parent,
                    role=meta["role"],
                    params=int(meta["params"]),
                    default=bool(meta.get("default", False)),
                    draft=meta.get("draft"),
                    description=meta.get("description", ""),
                )
            )
    return sorted(models, key=lambda m: (m.role != "target", m.name))


def find_embedded(name: str) -> EmbeddedModel | None:
    """The embedded model called ``name``, or None."""
    return next((m for m in list_models() if m.name == name), None)


def default_target() -> EmbeddedModel | None:
    """The default target model (the one marked ``default``), or None if none is shipped."""
    targets = [m for m in list_models() if m.role == "target"]
    return next((m for m in targets if m.default), targets[0] if targets else None)


def paired_draft(target: EmbeddedModel) -> EmbeddedModel | None:
    """The draft model paired with an embedded target, or None."""
    return find_embedded(target.draft) if target.draft else None
