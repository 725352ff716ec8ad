"""Reading JSONL input files (prompt files): one JSON object per line, blank lines skipped;
and the checks of a command's input and output paths.

Every problem is one line naming the file and line, raised as the caller's error type, so
each command keeps its own exit path and its own checks of the objects' fields.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def check_input_file(path: str | Path, what: str, error: type[Exception] = ValueError) -> Path:
    """``path`` as a Path if it is a file; else ``error`` saying what it is instead (missing,
    a directory, something else) and what to pass. ``what`` names it (e.g. "prompt file")."""
    path = Path(path)
    if path.is_dir():
        raise error(f"{what} {path} is a directory; pass a file")
    if not path.exists():
        raise error(f"{what} not found: {path} does not exist")
    if not path.is_file():
        raise error(f"{what} {path} is not a regular file; pass a file")
    return path


def check_writable(path: str | Path, what: str, error: type[Exception] = ValueError, directory: bool = False) -> None:
    """Raise ``error`` now if ``path`` (a file, or a ``directory`` to create or fill) could
    not be written later: a command that trains or measures for minutes should not end in
    a traceback. Creates nothing: it probes the nearest existing folder with a temporary
    directory (``os.access`` says yes to root everywhere, ``/proc`` included)."""
    path = Path(path)
    if not directory and path.is_dir():
        raise error(f"{what} {path} is a directory; give a file name")
    folder = path if directory else path.parent
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise error(f"{what} {path}: {existing} is not a directory; choose another path")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".quickdraft-write-test-", dir=existing))
        if not directory and path.exists():
            with open(path, "a"):
                pass
    except OSError as exc:
        raise error(f"{what} {path}: cannot write there ({exc.strerror or exc}); choose a writable path") from None


def read_objects(path: str | Path, what: str, error: type[ValueError] = ValueError) -> Iterator[tuple[str, dict]]:
    """``(where, obj)`` per non-blank line of ``path``, ``where`` being ``"PATH:LINE"`` for the
    caller's own messages. ``what`` names the file in errors (e.g. "prompts file")."""
    path = check_input_file(path, what, error)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise error(f"cannot read {what} {path}: it is not UTF-8 text") from None
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise error(f"{where}: line {number} is not JSON ({exc.msg}); write one JSON object per line") from None
        if not isinstance(obj, dict):
            raise error(f"{where}: line {number} is not a JSON object; write one object per line, "
                        "e.g. {\"prompt\": \"...\"}")
        yield where, obj
