"""Stop conditions, checked token by token so speculative decoding stops exactly where
plain decoding would, even in the middle of an accepted chunk."""

from __future__ import annotations

import numbers
import re
from collections.abc import Sequence

from .detokenize import IncrementalDetokenizer


def check_count(value, name: str, minimum: int) -> int:
    """``value`` if it is an integer of at least ``minimum``; else a one-line TypeError or
    ValueError naming ``name`` (a float count failed deep in torch: "zeros(): argument
    'size' failed to unpack")."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class StopConditions:
    """EOS ids, stop strings and a token budget.

    ``check(token)`` is called for every emitted token in order and returns the finish
    reason (``"stop"`` or ``"length"``) when generation ends at it, else None. An EOS token
    is not part of the output; a token that completes a stop string is (its text is cut
    at the stop string).
    """

    def __init__(
        self,
        max_new_tokens: int,
        eos_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        tokenizer=None,
    ) -> None:
        check_count(max_new_tokens, "max_new_tokens", 1)
        if stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer to see the text")
        self.max_new_tokens = max_new_tokens
        self.eos = set(eos_token_ids)
        self.stop_strings = [s for s in stop_strings if s]
        self._detok = IncrementalDetokenizer(tokenizer) if self.stop_strings else None
        self._text = ""
        self._longest = max((len(s) for s in self.stop_strings), default=0)
        self.count = 0

    def is_eos(self, token: int) -> bool:
        return token in self.eos

    def check(self, token: int) -> str | None:
        """Register an emitted (non-EOS) token; return the finish reason if it ends generation."""
        self.count += 1
        if self._detok is not None:
            delta = self._detok.push([token])
            if delta:
                window_start = max(0, len(self._text) - self._longest)
                self._text += delta
                window = self._text[window_start:]
                if any(s in window for s in self.stop_strings):
                    return "stop"
        if self.count >= self.max_new_tokens:
            return "length"
        return None


def cut_at_stop(text: str, stop_strings: Sequence[str]) -> str:
    """``text`` up to (excluding) the earliest occurrence of any stop string."""
    cut = len(text)
    for s in stop_strings:
        if s:
            i = text.find(s)
            if i != -1:
                cut = min(cut, i)
    return text[:cut]


_SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\"}
_ESCAPE = re.compile(r"\\(?:([ntr0\\])|x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|([xuU]))")


def unescape(text: str) -> str:
    """Interpret the usual backslash escapes in a string typed on a command line:
    ``\\n``, ``\\t``, ``\\r``, ``\\0``, ``\\\\``, ``\\xHH``, ``\\uXXXX`` and ``\\UXXXXXXXX``.
    Any other backslash is kept as it is (``\\d`` stays two characters).

    >>> unescape(r"\n\n") == "\n\n"
    True
    """

    def replace(m: re.Match) -> str:
        simple, hex2, hex4, hex8, bad = m.groups()
        if simple is not None:
            return _SIMPLE_ESCAPES[simple]
        if bad is not None:
            digits = {"x": 2, "u": 4, "U": 8}[bad]
            raise ValueError(f"\\{bad} needs {digits} hex digits in {text!r}")
        code = int(hex2 or hex4 or hex8, 16)
        if code > 0x10FFFF:
            raise ValueError(f"{m.group(0)} is not a Unicode character")
        return chr(code)

    return _ESCAPE.sub(replace, text)
