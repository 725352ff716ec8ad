"""The error every checkpoint reader raises (directories, GGUF files, packaged models)."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint cannot be used; the message says what is wrong and what to do."""
