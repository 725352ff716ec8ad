"""Terminal output shared by ``quickdraft generate`` and ``quickdraft demo``: colour choice
and the streaming loop that marks accepted draft tokens."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import TextIO

GREEN, RESET = "\033[32m", "\033[0m"


def use_color(mode: str = "auto", out: TextIO | None = None) -> bool:
    """``always``, ``never``, or ``auto``: colour when ``out`` (stdout) is a terminal and
    ``NO_COLOR`` is not set."""
    if mode == "always":
        return True
    if mode == "never" or os.environ.get("NO_COLOR"):
        return False
    return (out or sys.stdout).isatty()


def green(text: str, color: bool) -> str:
    return f"{GREEN}{text}{RESET}" if color else text


def write_stream(chunks: Iterable, color: bool, out: TextIO | None = None) -> None:
    """Write streamed :class:`~quickdraft.generator.TextChunk` s as they come, accepted
    draft text in green when ``color``."""
    out = out or sys.stdout
    for chunk in chunks:
        for text, from_draft in chunk.segments:
            out.write(green(text, color and from_draft))
        out.flush()
