"""A drafter's frequency-ranked vocabulary: ``draft_vocab.json`` next to its weights.

``quickdraft train draft`` counts the tokens of its training text and writes every token
id, most frequent first, with the number it keeps by default. Loaded as a draft
(:func:`quickdraft.pair.load_pair`), the model's LM head then scores only those tokens
(:meth:`Transformer.restrict_head`): a cheaper draft step, the same output (the target
still decides every token). Measured on the embedded draft: its greedy agreement with the
target is within half a point at 1024 of 8192 tokens.

Heads use the same file and the same ``--draft-vocab N``: a prophet (``train heads --kind
prophet``) and an exit head (``train exit-head``) rank the whole vocabulary, as a draft
does (an exit head drafts through the target's LM head rows of its N most frequent
tokens); an EAGLE drafter (``train heads --kind eagle``), whose reduced head stores rows
for some tokens only, ranks those tokens, so N picks the most frequent of its rows (the
ranking's length: all of them).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

VOCAB_FILE = "draft_vocab.json"


def default_vocab_size(vocab_size: int) -> int:
    """The draft vocabulary ``train draft`` keeps by default: an eighth of the target's,
    at least 1024 tokens, in multiples of 64 (0: the whole vocabulary)."""
    size = max(1024, -(-vocab_size // 8 // 64) * 64)
    return 0 if size >= vocab_size else size


def write_draft_vocab(out_dir: Path, counts: np.ndarray, size: int, ids: np.ndarray | None = None) -> dict:
    """Rank token ids by ``counts`` (ties: lower id first) and write ``draft_vocab.json``;
    with ``ids``, rank only those (an EAGLE drafter's stored rows)."""
    ranking = np.argsort(-counts, kind="stable")
    if ids is not None:
        ranking = ranking[np.isin(ranking, np.asarray(ids))]
    covered = float(counts[ranking[:size]].sum() / max(counts.sum(), 1)) if size else 1.0
    record = {"size": int(size), "method": "token frequency in the training text (FR-Spec)",
              "counted_tokens": int(counts.sum()), "size_covers": covered,
              "ranking": [int(i) for i in ranking]}
    (Path(out_dir) / VOCAB_FILE).write_text(json.dumps(record) + "\n")
    return record


def read_draft_vocab(model_dir: Path, size: int | None = None) -> torch.Tensor | None:
    """The token ids a drafter in ``model_dir`` scores: the ``size`` most frequent (None:
    the file's default; 0 or the whole ranking: all, returned as None). Raises ValueError
    for a size the file cannot give."""
    path = Path(model_dir) / VOCAB_FILE
    if size == 0 or (size is None and not path.exists()):
        return None
    if not path.exists():
        raise ValueError(f"--draft-vocab {size}: {model_dir} has no {VOCAB_FILE} (its trainer writes one: "
                         "`quickdraft train draft`, `train heads`, `train exit-head`); use --draft-vocab 0")
    record = json.loads(path.read_text())
    ranking = record["ranking"]
    size = record["size"] if size is None else size
    if size < 0 or size > len(ranking):
        raise ValueError(f"--draft-vocab must be between 0 (all) and {len(ranking)}, got {size}")
    return None if size in (0, len(ranking)) else torch.tensor(ranking[:size], dtype=torch.long)


def spread_logits(scores: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Scores ``[..., len(ids)]`` of the tokens ``ids`` as logits over the whole vocabulary
    ``[..., vocab_size]``: ``-inf`` elsewhere, so those tokens are never drafted (greedy) and
    have probability zero (sampled), which the exact acceptance rule allows for."""
    out = scores.new_full((*scores.shape[:-1], vocab_size), float("-inf"))
    return out.index_copy_(out.dim() - 1, ids, scores)
