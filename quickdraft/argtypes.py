"""argparse ``type`` converters shared by every sub-command's parser: each converts, checks
and names what it wanted in argparse's one-line error (``must be a positive integer, got 0``)."""

from __future__ import annotations

import argparse


def _checked(convert, ok, requirement: str, name: str):
    """An argparse ``type`` that converts and then checks a value. argparse names the
    type in its message when conversion fails, so ``name`` is what reads well there."""

    def parse(text: str):
        value = convert(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text}")
        return value

    parse.__name__ = name
    return parse


positive_int = _checked(int, lambda v: v >= 1, "a positive integer", "positive integer")
non_negative_int = _checked(int, lambda v: v >= 0, ">= 0", "integer >= 0")
non_negative_float = _checked(float, lambda v: v >= 0, ">= 0", "number >= 0")
positive_float = _checked(float, lambda v: v > 0, "> 0", "number > 0")
port_number = _checked(int, lambda v: 0 <= v <= 65535, "in 0..65535", "port number")
probability = _checked(float, lambda v: 0 < v <= 1, "in (0, 1]", "number in (0, 1]")
