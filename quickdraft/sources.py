"""Where the bench's prompts come from, shared by the bench (which builds them) and training
(which must never train on them): the out-of-domain packages, their source files and
licences, and the source files of the stored prompt sets."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

#: Packages the bench's out-of-domain prompts are cut from; training data never includes them.
OOD_PACKAGES = ("rich", "tqdm", "transformers", "huggingface_hub", "matplotlib")
#: The stored prompt sets (one JSONL file per category).
BENCH_ASSETS_DIR = Path(__file__).resolve().parent / "assets" / "bench"


def package_license(dist) -> str:
    """A distribution's licence as its metadata states it (SPDX expression, short License
    field, or the licence classifier)."""
    meta = dist.metadata
    expression = meta.get("License-Expression")
    if expression:
        return expression
    text = (meta.get("License") or "").strip()
    if text and "\n" not in text and len(text) <= 60:
        return text
    classifiers = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    if classifiers:
        return "; ".join(classifiers)
    return text.splitlines()[0] if text else "unknown"


def package_files(dist, package: str) -> list[tuple[str, Path]]:
    """(path inside the package's distribution, local path) of its ``.py`` files, tests and
    vendored code left out, ordered by a hash of the path."""
    out = []
    for f in dist.files or ():
        rel = str(f).replace("\\", "/")
        parts = rel.split("/")
        if not rel.endswith(".py") or parts[0] != package:
            continue
        if any(p in ("tests", "test", "testing", "_vendor", "vendor", "vendored", "externals") for p in parts):
            continue
        if parts[-1].startswith("test_") or parts[-1] == "conftest.py":
            continue
        out.append((rel, Path(str(dist.locate_file(f)))))
    return sorted(out, key=lambda item: hashlib.sha256(("ood-file\0" + item[0]).encode()).hexdigest())


def bench_source_files() -> set[str]:
    """Paths (relative to their package or stdlib root) the stored bench prompts come from."""
    files = set()
    for path in sorted(BENCH_ASSETS_DIR.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                source = (json.loads(line).get("source") or "").rpartition(": ")[2]  # "rich 15.0.0: rich/pretty.py:424"
                if source:
                    files.add(source.rsplit(":", 1)[0])
    return files
