"""Packing the corpus into one token stream and sampling training windows from it.

Each document is preceded by ``<|endoftext|>`` (id 0): ``EOT doc1 EOT doc2 ...``.  Streams are
``np.uint16`` arrays cached as ``.npy`` files next to a JSON key (tokenizer + corpus hash), so
re-running a stage does not re-tokenize.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # (torch is imported where it runs: reading the corpus needs none)
    import torch


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


@dataclass
class Windows:
    """Training windows ``tokens`` ``[B, L + 1]`` and ``answers`` ``[B, L + 1]`` (bool): whether
    each token is the target's own writing, not a prompt (:func:`.distill.answer_flags`)."""

    tokens: torch.Tensor
    answers: torch.Tensor

    def to(self, device) -> Windows:
        return Windows(self.tokens.to(device), self.answers.to(device))


def sample_batch(stream: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int,
                 answers: np.ndarray | None = None) -> torch.Tensor | Windows:
    """Random windows of ``seq_len + 1`` tokens; depends only on (seed, step), so resumable.
    With ``answers`` (a flag per token of ``stream``): :class:`Windows` of both, the same
    windows."""
    import torch

    rng = np.random.default_rng([seed, step])
    hi = stream.size - (seq_len + 1)
    if hi <= 0:
        raise ValueError(f"token stream ({stream.size}) shorter than seq_len+1 ({seq_len + 1})")
    starts = rng.integers(0, hi + 1, size=batch_size)
    x = torch.from_numpy(np.stack([stream[s : s + seq_len + 1] for s in starts]).astype(np.int64))
    if answers is None:
        return x
    return Windows(x, torch.from_numpy(np.stack([answers[s : s + seq_len + 1] for s in starts])))


def batch_parts(batch: torch.Tensor | Windows) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A batch's token windows and its answer flags (None: every token counts)."""
    return (batch.tokens, batch.answers) if isinstance(batch, Windows) else (batch, None)


def answer_runs(answers: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` flags -> how many answer tokens end at each place (0 at a prompt token;
    counted from the window's start): a draft at depth d predicting token i is trained on
    iff ``runs[i] >= d + 1``, since the d tokens before it were drafted too, and a drafted
    token is an answer token when decoding."""
    import torch

    places = torch.arange(answers.shape[1], device=answers.device).expand(answers.shape)
    last_prompt = torch.where(answers.bool(), -1, places).cummax(dim=1).values
    return places - last_prompt


def window_runs(answers: np.ndarray, start: int, length: int, device) -> torch.Tensor:
    """:func:`answer_runs` ``[1, length + 1]`` of a held-out window ``start .. start + length - 1``
    and the token after it (a prompt token past the stream's end)."""
    import torch

    flags = np.zeros(length + 1, dtype=bool)
    part = answers[start : start + length + 1]
    flags[: part.size] = part
    return answer_runs(torch.as_tensor(flags, device=device)[None])


def masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The mean of ``values`` where ``mask`` is set (all of them for None); 0 where none is."""
    if mask is None:
        return values.mean()
    return (values * mask).sum() / mask.sum().clamp(min=1)


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
