"""The training corpus: the ``.py`` files of the running interpreter's standard library.

What is included
    Every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` except anything inside
    ``site-packages`` (third-party code, differs between machines) and the test suites:
    directories named ``test`` or ``tests`` and ``idlelib/idle_test``.

Why the test suites are excluded
    In CPython 3.11 the tests are about 62% of the stdlib's ``.py`` bytes (19.4 MB of
    31.5 MB).  They are highly repetitive (long tables of ``self.assertEqual``
    calls, generated data, deliberately malformed code and odd encodings), so in a small
    training budget -- the default family sees a few million tokens -- they would dominate
    what the model learns, while the library code itself is closer to the code people ask a
    drafting model to continue.  Excluding them also keeps tokenization and packing fast.

Split
    Whole files go to validation when the first 8 bytes of ``sha256(relative_path)`` map
    below ``val_fraction`` (default 5%).  The split depends only on the relative POSIX path,
    so it is deterministic across runs and machines, and stable when files are added.

Files are read as UTF-8; files that do not decode are skipped and counted in the manifest.
Empty files (e.g. some ``__init__.py``) carry no text and are left out.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "__pycache__"})
EXCLUDED_SUBPATHS = ("idlelib/idle_test",)
DEFAULT_VAL_FRACTION = 0.05


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_validation(rel_path: str, val_fraction: float = DEFAULT_VAL_FRACTION) -> bool:
    """Whether the file at ``rel_path`` (POSIX, relative to the corpus root) is held out."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


def list_source_files(
    root: Path, include_tests: bool = False, max_files: int | None = None
) -> list[str]:
    """Relative POSIX paths of the corpus ``.py`` files under ``root``, sorted."""
    root = Path(root)
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        keep = []
        for d in dirnames:
            sub = f"{rel_dir}/{d}" if rel_dir != "." else d
            if d == "site-packages" or d == "__pycache__":
                continue
            if not include_tests and (d in EXCLUDED_DIRS or sub in EXCLUDED_SUBPATHS):
                continue
            keep.append(d)
        dirnames[:] = sorted(keep)
        for f in filenames:
            if f.endswith(".py"):
                out.append(f"{rel_dir}/{f}" if rel_dir != "." else f)
    out.sort()
    if max_files is not None:
        out = out[:max_files]
    return out


@dataclass
class Corpus:
    """Documents of the train and validation splits plus a manifest describing them."""

    root: Path
    train: list[tuple[str, str]] = field(default_factory=list)  # (rel_path, text)
    val: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    include_tests: bool = False
    val_fraction: float = DEFAULT_VAL_FRACTION

    @property
    def train_texts(self) -> list[str]:
        return [t for _, t in self.train]

    @property
    def val_texts(self) -> list[str]:
        return [t for _, t in self.val]

    def manifest(self) -> dict:
        """Python version, file counts, bytes, sha256 of the concatenation, split sizes."""
        h = hashlib.sha256()
        total_bytes = 0
        for rel, text in sorted(self.train + self.val):
            data = text.encode("utf-8")
            h.update(rel.encode("utf-8") + b"\0" + data + b"\0")
            total_bytes += len(data)
        nbytes = lambda docs: sum(len(t.encode("utf-8")) for _, t in docs)  # noqa: E731
        return {
            "source": "python stdlib .py files (sysconfig stdlib path)",
            "python_version": sys.version.split()[0],
            "python_implementation": sys.implementation.name,
            "root": str(self.root),
            "include_tests": self.include_tests,
            "excluded": ["site-packages"]
            + ([] if self.include_tests else ["test/", "tests/", "idlelib/idle_test/"]),
            "files": len(self.train) + len(self.val),
            "bytes": total_bytes,
            "sha256": h.hexdigest(),
            "sha256_of": "sorted(files): rel_path + NUL + utf8 text + NUL",
            "skipped_undecodable": len(self.skipped),
            "split": {
                "method": f"sha256(rel_path)[:8] / 2**64 < {self.val_fraction}",
                "train_files": len(self.train),
                "train_bytes": nbytes(self.train),
                "val_files": len(self.val),
                "val_bytes": nbytes(self.val),
            },
        }


def load_corpus(
    root: Path | None = None,
    include_tests: bool = False,
    max_files: int | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
) -> Corpus:
    """Read the corpus under ``root`` (default: the stdlib) and split it."""
    root = Path(root) if root is not None else stdlib_root()
    corpus = Corpus(root=root, include_tests=include_tests, val_fraction=val_fraction)
    for rel in list_source_files(root, include_tests=include_tests, max_files=max_files):
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            corpus.skipped.append(rel)
            continue
        if not text:
            continue
        (corpus.val if is_validation(rel, val_fraction) else corpus.train).append((rel, text))
    if not corpus.val and len(corpus.train) > 1:
        # Tiny corpora (tests, --max-files): make sure validation is never empty.
        corpus.val.append(corpus.train.pop())
    return corpus
