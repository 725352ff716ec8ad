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


# --- the README's examples run as written ----------------------------------------------------

import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

RUNNABLE = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python"}
SKIP = re.compile(r"<!--\s*readme-test:\s*skip\s*\(([^)]+)\)\s*-->")


def readme_blocks(text: str) -> list[tuple[int, str, str, str | None]]:
    """(line, language, code, skip reason) of every fenced code block of a runnable
    language. A block is skipped only when the line before it (blank lines aside) is
    ``<!-- readme-test: skip (reason) -->``."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        skip = SKIP.search(before)
        if fence.group(1) in RUNNABLE:
            blocks.append((i + 1, RUNNABLE[fence.group(1)], "\n".join(lines[i + 1 : end]) + "\n",
                           skip.group(1).strip() if skip else None))
        i = end + 1
    return blocks


BLOCKS = readme_blocks((ROOT / "README.md").read_text())
QUICKDRAFT_COMMANDS = ("quickdraft", "python")  # the commands that start the CLI (or Python)


def block_commands(line: int, code: str) -> list[tuple[int, str]]:
    """(line, text) of each command of a shell block, a backslash-continued command whole."""
    commands, start, parts = [], None, []
    for offset, text in enumerate(code.splitlines(), start=1):
        if start is None:
            if not text.strip():
                continue
            start = line + offset
        parts.append(text)
        if not text.rstrip().endswith("\\"):
            commands.append((start, "\n".join(parts)))
            start, parts = None, []
    if parts:
        commands.append((start, "\n".join(parts)))
    return commands


def readme_cases(blocks) -> list[tuple[str, str, str, str | None]]:
    """(id, language, code, skip reason) of each test case. A Python block runs whole. A
    shell block runs one case per command that starts the CLI (each its own test, so that
    xdist spreads them over the workers): the shell lines before it in the block that do not
    (``printf ... > prompt.py``) run first, as written, in the same directory. A skipped block
    is one skipped case."""
    cases = []
    for line, language, code, skip in blocks:
        if language != "bash" or skip:
            cases.append((f"README.md:{line}", language, code, skip))
            continue
        setup: list[str] = []
        for at, command in block_commands(line, code):
            if command.split(maxsplit=1)[0] in QUICKDRAFT_COMMANDS:
                cases.append((f"README.md:{at}", language, "\n".join([*setup, command]) + "\n", None))
            else:
                setup.append(command)
    return cases


CASES = readme_cases(BLOCKS)


def test_readme_has_runnable_examples_and_the_two_command_quickstart():
    text = (ROOT / "README.md").read_text()
    quickstart = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    commands = [line.split("#")[0].strip() for block in re.findall(r"```bash\n(.*?)```", quickstart, re.S)
                for line in block.splitlines() if line.split("#")[0].strip()]
    assert commands == ["make demo", "make test"]
    assert sum(1 for *_, skip in BLOCKS if skip is None) >= 2
    assert all(skip for *_, skip in BLOCKS if skip is not None)  # a skip always gives its reason


def test_every_line_of_every_runnable_shell_block_is_run():
    """The per-command cases leave no line of a runnable shell block out, and each CLI
    command of one is the last command of exactly one case."""
    for line, language, code, skip in BLOCKS:
        if language != "bash" or skip:
            continue
        commands = [c for _, c in block_commands(line, code)]
        assert "\n".join(commands) == code.strip("\n"), f"README.md:{line}"
        in_cases = {ln for _, _, case, _ in CASES for ln in case.splitlines()}
        assert set(code.strip("\n").splitlines()) <= in_cases, f"README.md:{line}"
        for command in commands:
            if command.split(maxsplit=1)[0] in QUICKDRAFT_COMMANDS:
                assert sum(case.endswith(f"\n{command}\n") or case == f"{command}\n"
                           for _, _, case, _ in CASES) == 1, command


@pytest.fixture(scope="module")
def shims(tmp_path_factory):
    """``quickdraft`` and ``python`` commands that run this checkout with this interpreter."""
    bin_dir = tmp_path_factory.mktemp("bin")
    for name, target in (("quickdraft", f'"{sys.executable}" -m quickdraft'), ("python", f'"{sys.executable}"')):
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\nexec {target} "$@"\n')
        path.chmod(0o755)
    return bin_dir


def run_readme_code(language: str, code: str, shims, cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{shims}{os.pathsep}{os.environ['PATH']}", NO_COLOR="1",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    command = ["bash", "-e", "-o", "pipefail", "-c", code] if language == "bash" else [sys.executable, "-c", code]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow  # each case starts the CLI (or Python) once
@pytest.mark.parametrize("case,language,code,skip", CASES, ids=[c[0] for c in CASES])
def test_readme_block_runs_as_written(case, language, code, skip, shims, tmp_path):
    if skip:
        pytest.skip(f"marked in the README: {skip}")
    proc = run_readme_code(language, code, shims, tmp_path)
    assert proc.returncode == 0, f"{case} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr
    if "--prompt-file prompt.py" in code:
        # The sampled `--prompt-file` example prints a completion: its prompt used to end in
        # a bare newline, the embedded model's first sampled token was EOS, and it printed
        # nothing. (Its case is the printf line and this one, as test_readme_sampled_example
        # checks.)
        import json

        out = json.loads(proc.stdout)
        assert out["text"].strip() and out["stats"]["new_tokens"] > 0, out["stats"]


def test_readme_sampled_example_shows_text():
    """The sampled `--prompt-file` example is one case: the prompt's printf line and the
    sampled line with --json, so that case's check (the completion is not empty) applies to it."""
    block = next(code for _, _, code, _ in BLOCKS if "--prompt-file prompt.py" in code)
    lines = [line for line in block.splitlines() if "prompt.py" in line]
    assert lines[0].startswith("printf ") and "--temperature" in lines[1] and "--json" in lines[1], lines
    [case] = [code for _, _, code, _ in CASES if "--prompt-file prompt.py" in code]
    assert case.splitlines() == lines, case


def test_docs_scripts_import_what_the_package_has():
    """The scripts the documents tell you to run (docs/bench/*.py) import names that exist:
    two still imported load_tokenizer from quickdraft.generator and quickdraft.bench.exit_layer
    after they moved to quickdraft.pair and quickdraft.policy."""
    import ast
    import importlib

    broken = []
    for script in sorted((ROOT / "docs").rglob("*.py")):
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "quickdraft":
                try:
                    module = importlib.import_module(node.module)
                except ImportError:
                    broken.append(f"{script.name}: {node.module}")
                    continue
                broken += [f"{script.name}: {node.module}.{a.name}" for a in node.names
                           if not hasattr(module, a.name)]
    assert broken == []
