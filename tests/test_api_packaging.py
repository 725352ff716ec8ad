"""Package metadata: what setuptools reads from pyproject.toml, without warnings."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_metadata_gives_setuptools_no_warning(monkeypatch):
    pytest.importorskip("setuptools", minversion="77")  # SPDX license strings need setuptools >= 77
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    monkeypatch.chdir(ROOT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert [str(w.message).splitlines()[0] for w in caught] == []
    assert dist.metadata.license_expression == "MIT"
    assert (ROOT / "LICENSE").is_file() and "MIT License" in (ROOT / "LICENSE").read_text()
