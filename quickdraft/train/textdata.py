"""A user's training text for ``quickdraft train draft``: files, directories, JSONL, stdlib.

Each ``--data`` argument is a file, a directory (read recursively; hidden entries and
``__pycache__`` are skipped) or the word ``stdlib`` (the train split of the embedded
family's corpus, :mod:`.corpus`; its validation split becomes the held-out text).

- ``*.jsonl``: one JSON object per line; its ``"text"`` string is one document.
- a directory of self-distillation shards (``quickdraft train data``, :mod:`.shards`):
  its documents as the target's own token ids, used as they are (never re-tokenised).
- any other file: one document if it is UTF-8 text (source code, prose, ...); files that
  do not decode or hold NUL bytes (binaries) are skipped and counted.

Held-out documents are chosen by name with the corpus rule (``sha256(name)``, 5%), so the
split is stable when data is added; a single document is split at a line near 95%. A shard
document is chosen by its prompt's token ids instead: the shard sets answer the same
instructions many times (each set's catalogue, greedy and sampled; ~half the prompts recur),
and a held-out answer to a prompt trained on scored what the drafter memorised, not what it
predicts of a new request (SmolLM2's EAGLE drafter: 77% agreement on such held-out answers,
57% on the bench's chats; session 49).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import shards
from .corpus import is_validation, load_corpus

STDLIB = "stdlib"
SKIPPED_DIRS = frozenset({"__pycache__", "node_modules"})


class TrainInputError(ValueError):
    """Bad input to a training command: reported as one line, exit code 2."""


@dataclass
class TextData:
    """Train and held-out documents as ``(name, text)``, with where they came from."""

    train: list[tuple[str, str]] = field(default_factory=list)
    heldout: list[tuple[str, str]] = field(default_factory=list)
    files: list[dict] = field(default_factory=list)  # {"path", "bytes", "documents"}
    skipped: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    # documents given as token ids (self-distillation shards), split like the text
    train_ids: list[tuple[str, np.ndarray]] = field(default_factory=list)
    heldout_ids: list[tuple[str, np.ndarray]] = field(default_factory=list)
    prompt_tokens: dict[str, int] = field(default_factory=dict)  # how many of a shard document's ids are its prompt

    def manifest(self) -> dict:
        """Sources, files, bytes and the sha256 of the documents (tokens are added later)."""
        h = hashlib.sha256()
        for name, text in sorted(self.train + self.heldout):
            h.update(name.encode() + b"\0" + text.encode() + b"\0")
        for name, ids in sorted(self.train_ids + self.heldout_ids, key=lambda d: d[0]):
            h.update(name.encode() + b"\0" + ids.astype(np.uint32).tobytes() + b"\0")
        nbytes = lambda docs: sum(len(t.encode()) for _, t in docs)  # noqa: E731
        return {
            "sources": self.sources,
            "files": len(self.files),
            "bytes": sum(f["bytes"] for f in self.files),
            "sha256": h.hexdigest(),
            "skipped": len(self.skipped),
            "split": {"method": "sha256(document name, or a shard document's prompt ids)[:8] / 2**64 < 0.05",
                      "train_documents": len(self.train) + len(self.train_ids),
                      "train_bytes": nbytes(self.train),
                      "heldout_documents": len(self.heldout) + len(self.heldout_ids),
                      "heldout_bytes": nbytes(self.heldout),
                      "token_id_documents": len(self.train_ids) + len(self.heldout_ids)},
            "file_list": self.files,
        }


def prompt_key(ids: np.ndarray) -> str:
    """What a shard document is split by: its prompt's token ids, so every answer to one
    prompt lands on the same side."""
    return "prompt:" + hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()


def _walk(root: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIPPED_DIRS)
        out += [Path(dirpath) / f for f in sorted(filenames) if not f.startswith(".")]
    return out


def _documents(path: Path, name: str, skipped: list[str]) -> list[tuple[str, str]]:
    """The documents of one file (none if it holds no usable text)."""
    try:
        raw = path.read_bytes()
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        skipped.append(name)
        return []
    if "\0" in text:
        skipped.append(name)
        return []
    if path.suffix != ".jsonl":
        return [(name, text)] if text.strip() else []
    docs = []
    for i, line in enumerate(text.splitlines(), 1):
        try:
            rec = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            rec = None
        value = rec.get("text") if isinstance(rec, dict) else None
        if isinstance(value, str) and value.strip():
            docs.append((f"{name}#{i}", value))
        elif line.strip():
            skipped.append(f"{name}#{i}")
    return docs


def read_text_data(sources: list[str]) -> TextData:
    """Read ``--data`` arguments into train and held-out documents.

    Raises TrainInputError for a missing path, no files, or no usable text.
    """
    data = TextData(sources=[str(s) for s in sources])
    for src in sources:
        if str(src) == STDLIB:
            corpus = load_corpus()  # the family's corpus: train split only, val held out
            data.train += corpus.train
            data.heldout += corpus.val
            data.skipped += corpus.skipped
            for split, docs in (("train", corpus.train), ("heldout", corpus.val)):
                data.files += [{"path": f"stdlib:{rel}", "bytes": len(t.encode()),
                                "documents": 1, "split": split} for rel, t in docs]
            continue
        path = Path(src).expanduser()
        if not path.exists():
            raise TrainInputError(f"data path {src} does not exist; pass text, source or "
                                  "JSONL files, directories of them, or 'stdlib'")
        if shards.is_shard_dir(path):  # the target's own tokens: kept as ids
            try:
                docs = shards.read_documents(path)
            except (OSError, ValueError, KeyError) as exc:
                raise TrainInputError(f"cannot read the shards in {src}: {exc}") from None
            if not docs:
                raise TrainInputError(f"{src} holds no complete shard yet; generate some with "
                                      "`quickdraft train data --out` that directory")
            for name, ids, prompt_tokens in docs:
                name = f"{path.name}/{name}"
                key = prompt_key(ids[:prompt_tokens]) if prompt_tokens else name
                (data.heldout_ids if is_validation(key) else data.train_ids).append((name, ids))
                data.prompt_tokens[name] = prompt_tokens
            data.files.append({"path": str(path), "bytes": sum(int(i.nbytes) for _, i, _ in docs),
                               "documents": len(docs), "shards": len(shards.done_shards(path))})
            continue
        files = _walk(path) if path.is_dir() else [path]
        root = path if path.is_dir() else path.parent
        found, skipped = len(data.files), len(data.skipped)
        for f in files:
            name = f.relative_to(root).as_posix()
            docs = _documents(f, name, data.skipped)
            if docs:
                data.files.append({"path": str(f), "bytes": f.stat().st_size,
                                   "documents": len(docs)})
            for doc in docs:
                (data.heldout if is_validation(doc[0]) else data.train).append(doc)
        # Each source must give something: one that gives nothing beside others would
        # train on less than asked without a word (a shard set left behind by a copy).
        if len(data.files) == found:
            if len(data.skipped) > skipped:
                raise TrainInputError(
                    f"no usable text in {src}: {len(data.skipped) - skipped} files or JSONL lines skipped "
                    "(not UTF-8, binary, or JSONL without a \"text\" string)")
            raise TrainInputError(f"no data files with text in {src}; pass text, source or JSONL files, "
                                  "directories of them or shard directories, or leave it out")
    _ensure_heldout(data)
    return data


def _ensure_heldout(data: TextData) -> None:
    """Small data sets: hold out the last document, or the end of the only one."""
    if not data.train and not data.heldout:  # shards only: split their documents
        if not data.heldout_ids and len(data.train_ids) > 1:
            data.heldout_ids.append(data.train_ids.pop())
        if not data.train_ids:
            data.train_ids.append(data.heldout_ids.pop())
        return
    if not data.train:
        data.train.append(data.heldout.pop())
    if data.heldout:
        return
    if len(data.train) > 1:
        data.heldout.append(data.train.pop())
        return
    name, text = data.train[0]
    cut = text.rfind("\n", 0, int(len(text) * 0.95)) + 1 or int(len(text) * 0.95)
    data.train[0] = (name, text[:cut])
    data.heldout.append((f"{name}#end", text[cut:]))
