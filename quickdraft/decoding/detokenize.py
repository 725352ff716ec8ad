"""Incremental detokenisation that never splits a multi-byte UTF-8 character."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Byte-level BPE tokens can end inside a UTF-8 character; decoding such a prefix yields
    U+FFFD. We hold text back until the character is complete. Decoding restarts from a
    recent offset (not the whole sequence) so each push costs O(new tokens).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # start of the window we decode
        self._read = 0  # end of the text already returned, as a token index

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the newly completed text (possibly empty)."""
        self.ids.extend(token_ids)
        done = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        if len(text) > len(done) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return text[len(done) :]
        return ""

    def flush(self) -> str:
        """Whatever text is still held back (an incomplete character decodes as U+FFFD)."""
        done = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return text[len(done) :]
