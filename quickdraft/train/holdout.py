"""The bench's prompts, kept out of what quickdraft trains and retrieves from.

Self-distillation data (``quickdraft train data``) answers built-in instructions, and two
of them turned out to be near copies of bench chat prompts (session 40,
docs/smollm2/datastore.md). A document is held out when its prompt holds ``HOLDOUT_SHARE``
of a bench chat prompt's content words, or when it shares ``HOLDOUT_NGRAM`` tokens in a
row with any bench prompt (every category). ``train datastore`` leaves such documents out of
the store, and the trainers (:func:`~quickdraft.train.distill.tokenize`) out of training.
"""

from __future__ import annotations

import json
import re

import numpy as np

from ..models.registry import ASSETS_DIR
from .textdata import TextData

#: A document is held out when its prompt holds at least this share of a bench chat
#: prompt's words (SmolLM2's data asks "Write a Python function that returns the n-th
#: Fibonacci number." where the bench asks the same "using a loop": 6 of 8 words) ...
HOLDOUT_SHARE = 0.6
#: ... or when it shares this many tokens in a row with any bench prompt.
HOLDOUT_NGRAM = 12
BENCH_PROMPTS_DIR = ASSETS_DIR.parent / "bench"
_COMMON = frozenset("a an the in and of to is it that i how do can what write python my me for why are "
                    "you your with this on as be".split())


def words(text: str) -> frozenset[str]:
    """The content words of ``text`` (lower case, common words dropped)."""
    return frozenset(re.findall(r"[a-z0-9]+", text.lower())) - _COMMON


def _ngrams(ids: np.ndarray, n: int) -> set[bytes]:
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    return {ids[i : i + n].tobytes() for i in range(max(0, ids.shape[0] - n + 1))}


class Holdout:
    """The bench's prompts, to keep out of data: chat prompts by their words, every prompt by
    its token n-grams."""

    def __init__(self, chat_prompts: list[str], prompt_ids: list[np.ndarray]) -> None:
        self.chat_words = [w for w in (words(p) for p in chat_prompts) if w]
        self.ngrams: set[bytes] = set()
        for ids in prompt_ids:
            self.ngrams |= _ngrams(ids, HOLDOUT_NGRAM)

    def reason(self, prompt_text: str, ids: np.ndarray) -> str | None:
        """Why a document (its prompt's text, all its ids) is held out, or None."""
        have = words(prompt_text)
        for bench in self.chat_words:
            if len(bench & have) / len(bench) >= HOLDOUT_SHARE:
                return "asks a bench chat prompt"
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        for i in range(max(0, ids.shape[0] - HOLDOUT_NGRAM + 1)):
            if ids[i : i + HOLDOUT_NGRAM].tobytes() in self.ngrams:
                return f"shares {HOLDOUT_NGRAM} tokens with a bench prompt"
        return None


def bench_holdout(tokenizer) -> Holdout:
    """Every built-in bench prompt, all categories (read from the bench's prompt files:
    training sits below the bench and does not import it)."""
    prompts: list[tuple[str, str]] = []  # (category file, prompt)
    for path in sorted(BENCH_PROMPTS_DIR.glob("*.jsonl")):
        prompts += [(path.stem, json.loads(line)["prompt"]) for line in path.read_text().splitlines() if line.strip()]
    chat = [prompt for category, prompt in prompts if category == "chat"]
    ids = [np.asarray(tokenizer.encode(prompt, add_special_tokens=False)) for _, prompt in prompts]
    return Holdout(chat, ids)


def drop_bench_documents(data: TextData, tokenizer) -> list[dict]:
    """Take out of ``data`` the documents given as token ids (self-distillation shards) that
    ask a bench prompt; returns what was taken out, by name and reason."""
    if not (data.train_ids or data.heldout_ids):
        return []
    holdout = bench_holdout(tokenizer)
    dropped = []
    for docs in (data.train_ids, data.heldout_ids):
        kept = []
        for name, ids in docs:
            why = holdout.reason(tokenizer.decode(ids[: data.prompt_tokens.get(name, 0)].tolist()), ids)
            if why is None:
                kept.append((name, ids))
            else:
                dropped.append({"document": name, "why": why})
        docs[:] = kept
    return dropped
