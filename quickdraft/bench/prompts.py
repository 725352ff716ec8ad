"""Benchmark prompts: the JSONL format and the built-in prompt categories.

A prompt file is JSON lines, one object per line with ``id`` and ``prompt`` (strings) and
optionally ``kind`` (the task: ``function-body``, ``docstring``, ``repetitive``, ...),
``source``, ``category`` (results are reported per category; default ``custom``),
``size`` (``short`` or ``long``), ``origin`` (an object saying where the text comes
from) and ``messages`` (a chat: a list of ``{"role", "content"}`` objects, run through the
model's chat template; ``prompt`` then repeats the last message, for display). Blank lines
are ignored.

The built-in categories (``quickdraft bench --categories``), each a stored JSONL file in
``quickdraft/assets/bench/`` built by :mod:`.prompt_sets`:

- ``short``: up to ~120 tokens of context, from the validation split of the training
  corpus (held-out stdlib files);
- ``long``: 600-1500 tokens of context (counted with the embedded tokenizer), from the
  same validation split;
- ``out-of-domain``: Python the family never trained on, from third-party packages
  (package, version, file and licence in each prompt's ``origin``), short and long.

For instruct models (the default categories of a packaged model such as ``smollm2-135m``):

- ``chat``: one-turn user messages written for this bench (programming and general
  questions), rendered by the model's chat template; generation stops at its end-of-turn;
- ``code``: completions, the short function-body and docstring prompts of ``short`` and
  ``out-of-domain`` (same sources, so never in any training split).

A prompt longer than the model's context allows is cut to its end by the benchmark, which
says so in its output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..chat import ChatTemplateError, check_messages
from ..jsonl import read_objects
from ..sources import BENCH_ASSETS_DIR

CATEGORIES = ("short", "long", "out-of-domain")  # the embedded models' default
INSTRUCT_CATEGORIES = ("chat", "code")  # a packaged instruct model's default
ALL_CATEGORIES = CATEGORIES + INSTRUCT_CATEGORIES
CUSTOM = "custom"


class PromptFileError(ValueError):
    """A prompt file that is missing or malformed (message is one line)."""


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt; ``category`` groups the results."""

    id: str
    prompt: str
    kind: str = CUSTOM
    source: str = ""
    category: str = CUSTOM
    size: str = ""  # "short" or "long" where a set has both
    origin: dict | None = None  # where the text comes from (package, version, file, license)
    messages: tuple[dict, ...] | None = None  # a chat, rendered by the model's template

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    def to_json(self) -> dict:
        out = {"id": self.id, "prompt": self.prompt, "kind": self.kind, "source": self.source,
               "category": self.category}
        if self.size:
            out["size"] = self.size
        if self.origin:
            out["origin"] = self.origin
        if self.messages is not None:
            out["messages"] = list(self.messages)
        return out


def category_file(category: str) -> Path:
    """The stored prompt file of a built-in category."""
    return BENCH_ASSETS_DIR / f"{category}.jsonl"


def load_prompts(path: str | Path) -> list[BenchPrompt]:
    """Read a JSONL prompt file; raises :class:`PromptFileError` with a one-line message."""
    prompts: list[BenchPrompt] = []
    seen: set[str] = set()
    for where, obj in read_objects(path, "prompt file", PromptFileError):
        pid, prompt = obj.get("id"), obj.get("prompt")
        if isinstance(pid, int):
            pid = str(pid)
        if not isinstance(pid, str) or not pid:
            raise PromptFileError(f"{where}: 'id' must be a non-empty string")
        if not isinstance(prompt, str) or not prompt:
            raise PromptFileError(f"{where}: 'prompt' must be a non-empty string")
        if pid in seen:
            raise PromptFileError(f"{where}: duplicate id {pid!r}")
        origin = obj.get("origin")
        if origin is not None and not isinstance(origin, dict):
            raise PromptFileError(f"{where}: 'origin' must be a JSON object")
        messages = obj.get("messages")
        if messages is not None:
            try:
                messages = tuple(check_messages(messages))
            except ChatTemplateError as exc:
                raise PromptFileError(f"{where}: 'messages': {exc}") from None
        seen.add(pid)
        prompts.append(BenchPrompt(pid, prompt, str(obj.get("kind", CUSTOM)), str(obj.get("source", "")),
                                   str(obj.get("category") or CUSTOM), str(obj.get("size", "")), origin,
                                   messages))
    if not prompts:
        raise PromptFileError(f"prompt file {path} has no prompts")
    return prompts


def save_prompts(prompts: list[BenchPrompt], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps(p.to_json(), ensure_ascii=False) + "\n")


def parse_categories(text: str | None, available: tuple[str, ...] | None = ALL_CATEGORIES) -> tuple[str, ...] | None:
    """``--categories`` text (comma-separated) as names; None when not given. ``available``
    None accepts any name (a prompt file's categories are checked when selecting)."""
    if text is None:
        return None
    names = tuple(dict.fromkeys(c.strip() for c in text.split(",") if c.strip()))
    if not names:
        raise PromptFileError("--categories is empty")
    unknown = [c for c in names if available is not None and c not in available]
    if unknown:
        raise PromptFileError(f"unknown category {unknown[0]!r}; choose from: {', '.join(available)}")
    return names


def builtin_prompts(categories: tuple[str, ...] = CATEGORIES, per_category: int | None = None) -> list[BenchPrompt]:
    """The stored prompts of these built-in categories, in this order; ``per_category``
    keeps that many of each (:func:`quick_subset`)."""
    prompts: list[BenchPrompt] = []
    for category in parse_categories(",".join(categories)):
        prompts += [p for p in load_prompts(category_file(category)) if p.category == category]
    return select(prompts, None, per_category)


def select(prompts: list[BenchPrompt], categories: tuple[str, ...] | None = None,
           per_category: int | None = None) -> list[BenchPrompt]:
    """The prompts of these categories (all when None), grouped by category in order of
    first appearance; ``per_category`` keeps that many of each (:func:`quick_subset`)."""
    order = list(dict.fromkeys(p.category for p in prompts))
    if categories is not None:
        missing = [c for c in categories if c not in order]
        if missing:
            raise PromptFileError(f"no prompts of category {missing[0]!r}; the file has: {', '.join(order)}")
        order = list(categories)
    out: list[BenchPrompt] = []
    for category in order:
        group = [p for p in prompts if p.category == category]
        out += quick_subset(group, per_category) if per_category else group
    return out


def quick_subset(prompts: list[BenchPrompt], n: int = 4) -> list[BenchPrompt]:
    """Up to ``n`` prompts, round-robin over (size, kind) groups in order of first appearance."""
    groups: dict[tuple[str, str], list[BenchPrompt]] = {}
    for p in prompts:
        groups.setdefault((p.size, p.kind), []).append(p)
    out: list[BenchPrompt] = []
    depth = 0
    while len(out) < min(n, len(prompts)):
        for group in groups.values():
            if depth < len(group) and len(out) < n:
                out.append(group[depth])
        depth += 1
    return out
