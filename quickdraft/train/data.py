"""Packing the corpus into one token stream and sampling training windows from it.

Each document is preceded by ``<|endoftext|>`` (id 0): ``EOT doc1 EOT doc2 ...``.  Streams are
``np.uint16`` arrays cached as ``.npy`` files next to a JSON key (tokenizer + corpus hash), so
re-running a stage does not re-tokenize.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np


def encode_docs(tok, texts: list[str]) -> np.ndarray:
    """Token stream ``EOS doc EOS doc ...`` (no EOS if the tokenizer has none): uint16, or
    uint32 for vocabularies over 65536 tokens."""
    eos = [] if tok.eos_token_id is None else [tok.eos_token_id]
    dtype = np.uint16 if len(tok) <= 65536 else np.uint32
    if getattr(tok, "is_fast", False):
        ids = [e.ids for e in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]
    else:
        ids = tok(texts, add_special_tokens=False)["input_ids"] if texts else []
    parts = [np.asarray(eos + doc, dtype=dtype) for doc in ids]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def tokenizer_fingerprint(tok_dir: Path) -> str:
    return hashlib.sha256((Path(tok_dir) / "tokenizer.json").read_bytes()).hexdigest()[:16]


def cached_streams(tok, tok_dir: Path, corpus, cache_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) token streams, cached under ``cache_dir``."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    key = {"tokenizer": tokenizer_fingerprint(tok_dir), "corpus": corpus.manifest()["sha256"],
           "train_files": len(corpus.train), "val_files": len(corpus.val)}
    key_path = cache_dir / "tokens.json"
    tr_path, va_path = cache_dir / "tokens-train.npy", cache_dir / "tokens-val.npy"
    if key_path.exists() and tr_path.exists() and va_path.exists():
        if json.loads(key_path.read_text()).get("key") == key:
            return np.load(tr_path), np.load(va_path)
    train = encode_docs(tok, corpus.train_texts)
    val = encode_docs(tok, corpus.val_texts)
    np.save(tr_path, train)
    np.save(va_path, val)
    key_path.write_text(json.dumps({"key": key, "train_tokens": int(train.size),
                                    "val_tokens": int(val.size)}, indent=1))
    return train, val


def sample_batch(stream: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int):
    """Random windows of ``seq_len + 1`` tokens; depends only on (seed, step), so resumable."""
    import torch

    rng = np.random.default_rng([seed, step])
    hi = stream.size - (seq_len + 1)
    if hi <= 0:
        raise ValueError(f"token stream ({stream.size}) shorter than seq_len+1 ({seq_len + 1})")
    starts = rng.integers(0, hi + 1, size=batch_size)
    x = np.stack([stream[s : s + seq_len + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(x)


def eval_windows(stream: np.ndarray, seq_len: int, max_tokens: int | None = None):
    """Non-overlapping windows of ``seq_len + 1`` (sharing one boundary token) covering the stream.

    Every token except the first is predicted exactly once (up to ``max_tokens`` of them).
    """
    import torch

    n = stream.size
    out = []
    predicted = 0
    start = 0
    while start + 1 < n:
        end = min(start + seq_len + 1, n)
        out.append(torch.from_numpy(stream[start:end].astype(np.int64))[None])
        predicted += end - start - 1
        start = end - 1
        if max_tokens is not None and predicted >= max_tokens:
            break
    return out
