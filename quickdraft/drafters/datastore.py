"""A datastore of text the target wrote, searched for the sequence's tail (retrieval
drafting, as in REST, He et al. 2023): when the target's answers to other questions
continued the same tokens one way, propose that way.

The store is one array of token ids, documents separated by ``-1``, and an index of every
bigram's positions sorted by bigram. A lookup finds the positions of the sequence's last
two tokens, narrows them to the longest tail (up to ``max_ngram`` tokens) that still
occurs, and proposes the continuation most of those occurrences share, token by token.
It proposes only when that continuation is well supported (``confident``): a weak
retrieval costs a wider verify pass and would displace a model drafter's better guess.

A datastore directory (``quickdraft train datastore``) holds ``tokens.safetensors`` (one
uint16 tensor, uint32 for vocabularies past 65,535; documents end with the dtype's largest value),
``datastore.json`` (the target, its fingerprint, the sources) and a README card.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file

from ..models.exit_head import target_fingerprint
from ..models.lm import CausalLM, NativeLM

META_FILE = "datastore.json"
TOKENS_FILE = "tokens.safetensors"  # one tensor, "tokens" (safetensors: no pickles, and git takes it as weights)
TOKENS_KEY = "tokens"
KIND = "quickdraft-datastore"
DATASTORES_DIR = Path(__file__).resolve().parent.parent / "assets" / "datastores"

#: Gate on a retrieval (chosen on SmolLM2's chat answers with the bench prompts' near
#: duplicates taken out of the store, docs/smollm2/datastore.md): the first token must be
#: the continuation of at least this share of the matches ...
MIN_FIRST_SHARE = 0.8
#: ... and the match at least this long, or seen at least ``MIN_SUPPORT`` times (a
#: two-token tail seen once or twice was accepted 0.56 tokens a round, an EAGLE chain of
#: two ~0.76; longer or better supported ones 1.1-2.4).
MIN_CONFIDENT_NGRAM = 3
MIN_SUPPORT = 4
#: Later tokens stop the chain when fewer than this share of the remaining matches agree.
MIN_NEXT_SHARE = 0.5
#: Matches considered at most (a common bigram occurs tens of thousands of times; a
#: deterministic even subsample keeps a lookup ~0.1 ms).
MAX_MATCHES = 2048
MAX_PROPOSAL = 32  # the longest chain a lookup proposes (the padding after the last document)


@dataclass(frozen=True)
class Retrieval:
    """What a lookup found: the proposed ``tokens``, the matched tail's length ``ngram``,
    how many occurrences it had (``support``, at most ``MAX_MATCHES``) and the share of
    them whose next token was the proposed first token."""

    tokens: list[int]
    ngram: int
    support: int
    first_share: float


class Datastore:
    """Token sequences (``-1`` between documents) indexed by bigram."""

    def __init__(self, tokens: np.ndarray, max_ngram: int = 8, name: str = "datastore") -> None:
        if max_ngram < 2:
            raise ValueError(f"a datastore matches tails of at least 2 tokens; got max_ngram={max_ngram}")
        tokens = np.asarray(tokens, dtype=np.int64)
        self.name, self.max_ngram = name, max_ngram
        self.min_first_share, self.min_ngram, self.min_support = MIN_FIRST_SHARE, MIN_CONFIDENT_NGRAM, MIN_SUPPORT
        self.max_proposal = MAX_PROPOSAL
        self.size = int((tokens >= 0).sum())
        # -1 padding: a continuation read past the last document stops there
        self.tokens = np.concatenate([tokens, np.full(MAX_PROPOSAL + 1, -1)]).astype(np.int32)
        first, second = tokens[:-1], tokens[1:]
        starts = np.flatnonzero((first >= 0) & (second >= 0))
        keys = (first[starts] << 32) | second[starts]
        order = np.argsort(keys, kind="stable")  # stable: equal bigrams stay in text order
        self._keys, self._starts = keys[order], starts[order].astype(np.int64)

    def confident(self, found: Retrieval | None) -> bool:
        """Whether ``found`` is worth proposing (see ``MIN_FIRST_SHARE`` and ``MIN_SUPPORT``)."""
        return (found is not None and found.first_share >= self.min_first_share
                and (found.ngram >= self.min_ngram or found.support >= self.min_support))

    @classmethod
    def load(cls, path: str | Path) -> Datastore:
        """A datastore directory (one-line ValueError when it is not one); loaded once per
        process (the index takes ~0.6 s and ~50 MB for 3M tokens; drafters share it)."""
        return _load(Path(path).resolve())

    @classmethod
    def _read(cls, path: Path) -> Datastore:
        meta_path, tokens_path = path / META_FILE, path / TOKENS_FILE
        if not (meta_path.is_file() and tokens_path.is_file()):
            raise ValueError(f"{path} is not a datastore directory (no {META_FILE} and {TOKENS_FILE}); "
                             f"build one with `quickdraft train datastore`")
        meta = read_meta(path)
        try:
            raw = load_file(tokens_path)[TOKENS_KEY]
        except (OSError, KeyError, SafetensorError) as err:
            raise ValueError(f"{tokens_path}: not a datastore's token file ({err}); rebuild it with "
                             f"`quickdraft train datastore`") from None
        if raw.dtype not in (np.uint16, np.uint32) or raw.ndim != 1:
            raise ValueError(f"{tokens_path}: token ids must be one row of uint16 or uint32, not {raw.dtype} "
                             f"{list(raw.shape)}")
        tokens = raw.astype(np.int64)
        tokens[raw == np.iinfo(raw.dtype).max] = -1
        return cls(tokens, int(meta.get("max_ngram", 8)), name=path.name)

    def lookup(self, context: np.ndarray, k: int) -> Retrieval | None:
        """The continuation of at most ``k`` tokens after ``context`` (1-D ids), or None when
        its last two tokens never occur (or nothing follows them)."""
        length = context.shape[0]
        if length < 2 or k < 1:
            return None
        query = (int(context[-2]) << 32) | int(context[-1])
        lo, hi = np.searchsorted(self._keys, query, "left"), np.searchsorted(self._keys, query, "right")
        if lo == hi:
            return None
        where = self._starts[lo:hi]
        if where.shape[0] > MAX_MATCHES:
            where = where[:: -(-where.shape[0] // MAX_MATCHES)]
        ngram = 2
        while ngram < min(self.max_ngram, length):  # narrow to the longest tail that still occurs
            before = where - 1
            keep = self.tokens[before] == context[-ngram - 1]
            if not keep.any():
                break
            where, ngram = before[keep], ngram + 1
        follow = where + ngram
        out: list[int] = []
        support, first_share = follow.shape[0], 0.0
        for depth in range(min(k, self.max_proposal)):
            nxt = self.tokens[follow + depth]
            values, counts = np.unique(nxt, return_counts=True)
            best = int(counts.argmax())
            share = counts[best] / nxt.shape[0]
            if values[best] < 0 or (depth > 0 and share < MIN_NEXT_SHARE):
                break
            out.append(int(values[best]))
            if depth == 0:
                first_share = float(share)
                if not self.confident(Retrieval(out, ngram, support, first_share)):
                    break  # it will not be proposed: the rest of the chain is not worth finding
            follow = follow[nxt == values[best]]
        return Retrieval(out, ngram, support, first_share) if out else None


@lru_cache(maxsize=4)
def _load(path: Path) -> Datastore:
    return Datastore._read(path)


def read_meta(path: Path) -> dict:
    try:
        meta = json.loads((Path(path) / META_FILE).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path / META_FILE} is not readable JSON ({err}); rebuild it with "
                         f"`quickdraft train datastore`") from None
    if meta.get("kind") != KIND:
        raise ValueError(f"{path / META_FILE} is not a quickdraft datastore (kind {meta.get('kind')!r})")
    return meta


def shipped_datastore(target: CausalLM) -> Path | None:
    """The packaged datastore built from ``target``'s own text (by fingerprint), if any."""
    if not isinstance(target, NativeLM):
        return None
    return _shipped_by_fingerprint(DATASTORES_DIR).get(target_fingerprint(target.model))


@lru_cache(maxsize=4)
def _shipped_by_fingerprint(directory: Path) -> dict[str, Path]:
    """The packaged stores by their target's fingerprint, read once per process (the server
    builds a drafter per request; the package's files do not change under it)."""
    if not directory.is_dir():
        return {}
    found: dict[str, Path] = {}
    for path in sorted(directory.iterdir()):
        if (path / META_FILE).is_file():
            found.setdefault(read_meta(path).get("target_fingerprint"), path)
    return found


def resolve_datastore(target: CausalLM | None, choice: str | Path | Datastore | None) -> Datastore | None:
    """``--datastore``: a loaded store, a directory, ``"none"`` (off) or None (the one
    shipped for ``target``, if any)."""
    if isinstance(choice, Datastore):
        return choice
    if choice is None:
        path = shipped_datastore(target) if target is not None else None
        return Datastore.load(path) if path is not None else None
    if str(choice) == "none":
        return None
    return Datastore.load(choice)
