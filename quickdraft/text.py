"""Tokens to text: the finished :class:`Generation`, streamed :class:`TextChunk` s, and the
:class:`TextAssembler` that turns decode steps into text (whole characters, stop strings
held back until decided) for the API, the CLI and the server alike."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from .decoding.detokenize import IncrementalDetokenizer
from .decoding.engine import Step
from .decoding.stats import GenerationStats
from .decoding.stopping import cut_at_stop


@dataclass
class Generation:
    """A finished generation: the completion's text and ids (prompt excluded) and its stats."""

    text: str
    token_ids: list[int]
    stats: GenerationStats = field(default_factory=GenerationStats)


@dataclass
class TextChunk:
    """Text shown by one step, as segments ``(text, from_draft)``: ``from_draft`` marks text
    of draft tokens the target accepted (what a UI highlights)."""

    segments: list[tuple[str, bool]]

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self.segments)


def stop_strings(stop: str | Sequence[str] | None) -> list[str]:
    """``stop`` as a list: one string is one stop string (not a set of characters)."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
        raise TypeError(f"stop must be a string or a list of strings, got {stop!r}")
    return [s for s in stop if s]


class TextAssembler:
    """Turns engine steps into :class:`TextChunk` s, one step at a time (push, not pull, so
    a server can feed it steps as they come): multi-byte characters are kept whole and text
    that might begin a stop string is held back until it is decided. After a step that
    completes a stop string, ``stopped`` is True and the text ends before that string."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.stop = stop_strings(list(stop))
        self.stopped = False
        self._detok = IncrementalDetokenizer(tokenizer)
        self._pending: list[tuple[str, bool]] = []  # decoded but not yet shown (may start a stop string)
        self._recent = ""  # the tail of what was shown, to find stop strings that straddle chunks
        self._longest = max((len(s) for s in self.stop), default=0)

    def push(self, step: Step) -> TextChunk | None:
        """The text this step lets us show (None when there is none yet)."""
        if self.stopped:
            return None
        pending = self._pending
        pending.append((self._detok.push(step.tokens[: step.drafted]), True))
        pending.append((self._detok.push(step.tokens[step.drafted :]), False))
        text = "".join(t for t, _ in pending)
        show = len(text)
        if self.stop:
            window = self._recent + text
            found = len(cut_at_stop(window, self.stop))
            if found < len(window):  # a stop string completed: show up to it and end
                self.stopped = True
                shown = _take(pending, found - len(self._recent))[0]
                self._pending = []
                return TextChunk(shown) if shown else None
            show -= _stop_prefix_suffix(text, self.stop)
            self._recent = (self._recent + text[:show])[-self._longest :]
        shown, self._pending = _take(pending, show)
        return TextChunk(shown) if shown else None

    def flush(self) -> TextChunk | None:
        """What is still held back, once the generation has ended without a stop string."""
        if self.stopped:
            return None
        tail = "".join(t for t, _ in self._pending) + self._detok.flush()
        self._pending = []
        return TextChunk([(tail, False)]) if tail else None


class TextStream:
    """What :meth:`SpeculativeGenerator.stream` returns: an iterator of :class:`TextChunk`
    that also tells how the generation went.

    * ``stats``: the :class:`GenerationStats` of this generation. ``prompt_tokens`` and
      ``truncated_prompt_tokens`` are set before the first chunk; the counts grow as chunks
      come and are complete once the iterator is exhausted (``finished`` is then True).
    * ``text`` and ``token_ids``: what was generated so far (all of it once finished).
    * :meth:`result` consumes what is left and returns the :class:`Generation`.

    The prompt is tokenised when the stream is created, so a prompt that does not fit
    raises from ``stream()`` itself, before any text is shown. Breaking out of the loop
    early leaves the stats of a partial generation (``finish_reason`` stays empty).
    """

    def __init__(self, chunks: Iterator[TextChunk], steps: Iterator[Step], stats: GenerationStats,
                 token_ids: list[int]) -> None:
        self._chunks = chunks  # fills token_ids and stats as it goes
        self._steps = steps
        self.stats = stats
        self.token_ids = token_ids
        self.text = ""
        self.finished = False

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> TextChunk:
        try:
            chunk = next(self._chunks)
        except StopIteration:
            self.finished = True
            raise
        self.text += chunk.text
        return chunk

    def result(self) -> Generation:
        """Consume the rest of the stream; the finished :class:`Generation`."""
        for _ in self:
            pass
        return Generation(self.text, list(self.token_ids), self.stats)

    def close(self) -> None:
        """Stop generating (also what garbage collection of an unfinished stream does)."""
        self._chunks.close()
        self._steps.close()


def _take(segments: list[tuple[str, bool]], n: int) -> tuple[list[tuple[str, bool]], list[tuple[str, bool]]]:
    """Split segments after ``n`` characters, dropping empty ones."""
    head, rest = [], []
    for text, from_draft in segments:
        if n >= len(text):
            head.append((text, from_draft))
        elif n > 0:
            head.append((text[:n], from_draft))
            rest.append((text[n:], from_draft))
        else:
            rest.append((text, from_draft))
        n -= len(text)
    return [s for s in head if s[0]], [s for s in rest if s[0]]


def _stop_prefix_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
