"""The project's documents: citations point to files that exist, and the README's
examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS_DOC = ROOT / "docs" / "methods.md"
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".cfg", ".jsonl"}


def project_text_files():
    for path in [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml",
                 *(ROOT / "quickdraft").rglob("*"), *(ROOT / "tests").rglob("*"), *(ROOT / "docs").rglob("*")]:
        if path.is_file() and (path.suffix in TEXT_SUFFIXES or path.name == "Makefile"):
            yield path


def test_every_cited_document_exists():
    missing = "speculative-" + "decoding.md"  # the old citation, of a file the project never had
    offenders = [str(p.relative_to(ROOT)) for p in project_text_files() if missing in p.read_text(errors="ignore")]
    assert offenders == []
    headings = {line.lstrip("#").strip() for line in METHODS_DOC.read_text().splitlines() if line.startswith("#")}
    cited = set()
    for path in project_text_files():
        cited |= set(re.findall(r'docs/methods\.md, "([^"]+)"', path.read_text(errors="ignore")))
    assert cited and cited <= headings, cited - headings


def test_methods_doc_covers_every_method_with_its_rule():
    text = METHODS_DOC.read_text()
    for method in ["Plain decoding", "Draft model", "n-gram", "Hybrid", "static and dynamic", "MSS and SpecTr",
                   "Early exit", "Layer skip", "Adaptive draft stopping", "Medusa", "Prophet / EAGLE",
                   "Typical acceptance", "Batched"]:
        assert re.search(rf"^###.*{re.escape(method)}", text, re.M | re.I), method
    for rule in ["Greedy match", "Speculative sampling", "Deterministic drafts", "SpecTr (K-SEQ)"]:
        assert rule in text, rule
    assert text.count("lossless") >= 10
