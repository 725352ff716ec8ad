"""Benchmark prompts: the JSONL format and the default set built from the validation split.

A prompt file is JSON lines, one object per line with ``id`` and ``prompt`` (strings) and
optionally ``kind`` and ``source``. Blank lines are ignored.

The default set is built deterministically from the held-out (validation) files of the
training corpus (:mod:`quickdraft.train.corpus`: the stdlib ``.py`` files whose path hash
falls in the validation fraction), so the models never trained on these prompts. It covers
three kinds of work:

- ``function-body``: the context before a function, its signature and docstring; the
  model writes the body;
- ``repetitive``: the start of a run of same-shaped lines (tables, constant lists,
  registration calls); the model continues the pattern;
- ``docstring``: the context, a signature and an opening ``\"\"\"``; the model writes the
  docstring.

The set built on the interpreter that trained the shipped models is stored in
``quickdraft/assets/bench/default_prompts.jsonl`` (the stdlib differs between Python
versions, so the stored file is what ``quickdraft bench`` uses by default); rebuild it with
``python -m quickdraft.bench.prompts --out FILE``.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

KINDS = ("function-body", "repetitive", "docstring")
BENCH_ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets" / "bench"  # the stored prompt sets
DEFAULT_PROMPTS_FILE = BENCH_ASSETS_DIR / "default_prompts.jsonl"
MAX_PROMPT_CHARS = 420  # ~120 tokens: prompt + 128 new tokens stay inside the 256-token training window
PER_KIND = 4


class PromptFileError(ValueError):
    """A prompt file that is missing or malformed (message is one line)."""


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    prompt: str
    kind: str = "custom"
    source: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def load_prompts(path: str | Path) -> list[BenchPrompt]:
    """Read a JSONL prompt file; raises :class:`PromptFileError` with a one-line message."""
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"prompt file not found: {path}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptFileError(f"cannot read prompt file {path}: {exc}") from None
    prompts: list[BenchPrompt] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptFileError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise PromptFileError(f"{path}:{number}: expected a JSON object with 'id' and 'prompt'")
        pid, prompt = obj.get("id"), obj.get("prompt")
        if isinstance(pid, int):
            pid = str(pid)
        if not isinstance(pid, str) or not pid:
            raise PromptFileError(f"{path}:{number}: 'id' must be a non-empty string")
        if not isinstance(prompt, str) or not prompt:
            raise PromptFileError(f"{path}:{number}: 'prompt' must be a non-empty string")
        if pid in seen:
            raise PromptFileError(f"{path}:{number}: duplicate id {pid!r}")
        seen.add(pid)
        kind = obj.get("kind", "custom")
        prompts.append(BenchPrompt(pid, prompt, str(kind), str(obj.get("source", ""))))
    if not prompts:
        raise PromptFileError(f"prompt file {path} has no prompts")
    return prompts


def save_prompts(prompts: list[BenchPrompt], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps(p.to_json(), ensure_ascii=False) + "\n")


def default_prompts(quick: bool = False) -> list[BenchPrompt]:
    """The default prompt set (the stored file; built from the stdlib if it is missing).
    ``quick`` keeps the first prompt of each kind plus one more function body."""
    if DEFAULT_PROMPTS_FILE.is_file():
        prompts = load_prompts(DEFAULT_PROMPTS_FILE)
    else:
        prompts = build_default_prompts()
    return quick_subset(prompts) if quick else prompts


def quick_subset(prompts: list[BenchPrompt], n: int = 4) -> list[BenchPrompt]:
    """Up to ``n`` prompts, round-robin over kinds (in order of first appearance)."""
    by_kind: dict[str, list[BenchPrompt]] = {}
    for p in prompts:
        by_kind.setdefault(p.kind, []).append(p)
    out: list[BenchPrompt] = []
    depth = 0
    while len(out) < min(n, len(prompts)):
        for group in by_kind.values():
            if depth < len(group) and len(out) < n:
                out.append(group[depth])
        depth += 1
    return out


# --- building the default set -------------------------------------------------------------


def _key(*parts: object) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()


def _context_before(lines: list[str], start: int, budget: int) -> str:
    """Whole lines ending just before line index ``start``, as many as fit in ``budget`` chars."""
    out: list[str] = []
    used = 0
    for line in reversed(lines[:start]):
        if used + len(line) > budget:
            break
        out.append(line)
        used += len(line)
    while out and not out[-1].strip():  # do not start the prompt with blank lines
        out.pop()
    return "".join(reversed(out))


def _function_candidates(rel: str, text: str) -> tuple[list[tuple], list[tuple]]:
    """(function-body, docstring) candidates of one file: (key, prompt, source)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return [], []
    lines = text.splitlines(keepends=True)
    bodies, docs = [], []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.decorator_list:
            continue
        doc = ast.get_docstring(node, clean=False)
        if not doc or not node.body or len(node.body) < 2:
            continue
        first = node.body[0]
        header = "".join(lines[node.lineno - 1 : first.lineno - 1])
        doc_text = "".join(lines[first.lineno - 1 : first.end_lineno])
        body_lines = node.end_lineno - first.end_lineno
        if not header.rstrip().endswith(":") or body_lines < 3:
            continue
        source = f"{rel}:{node.lineno}"
        # function-body: signature + docstring, then the body
        if len(header) + len(doc_text) <= MAX_PROMPT_CHARS - 40:
            ctx = _context_before(lines, node.lineno - 1, MAX_PROMPT_CHARS - len(header) - len(doc_text))
            bodies.append((_key("body", source), ctx + header + doc_text, source))
        # docstring: signature + the opening quotes of the docstring
        opening = re.match(r"\s*(?:[rRuU]?)(\"\"\"|''')", lines[first.lineno - 1])
        if opening and len(header) <= MAX_PROMPT_CHARS - 40:
            start = lines[first.lineno - 1][: opening.end()]
            ctx = _context_before(lines, node.lineno - 1, MAX_PROMPT_CHARS - len(header) - len(start))
            docs.append((_key("doc", source), ctx + header + start, source))
    return bodies, docs


_SHAPE = re.compile(r"^(\s*)([A-Za-z_][\w.]*|'|\"|\(|\[|\{|[0-9])")


def _repetitive_candidates(rel: str, text: str, min_run: int = 8, shown: int = 5) -> list[tuple]:
    """Runs of >= ``min_run`` consecutive lines with the same indentation and leading token;
    the prompt is some context plus the first ``shown`` lines of the run."""
    lines = text.splitlines(keepends=True)
    out = []

    def shape(line: str):
        m = _SHAPE.match(line)
        return (m.group(1), m.group(2)) if m and line.strip() else None

    i = 0
    while i < len(lines):
        s = shape(lines[i])
        j = i
        while s is not None and j + 1 < len(lines) and shape(lines[j + 1]) == s:
            j += 1
        run = j - i + 1
        if s is not None and run >= min_run:
            head = "".join(lines[i : i + shown])
            if len(head) <= MAX_PROMPT_CHARS - 60 and max(len(x) for x in lines[i : i + shown]) < 120:
                ctx = _context_before(lines, i, MAX_PROMPT_CHARS - len(head))
                source = f"{rel}:{i + 1}"
                out.append((_key("rep", source), ctx + head, source))
        i = j + 1
    return out


def build_default_prompts(root: Path | None = None, per_kind: int = PER_KIND) -> list[BenchPrompt]:
    """Build the default prompt set from the validation split of the corpus under ``root``
    (default: this interpreter's stdlib). Deterministic: candidates are ordered by a hash of
    their kind and source location, and at most one prompt per file per kind is taken."""
    from ..train.corpus import is_validation, list_source_files, stdlib_root

    root = Path(root) if root is not None else stdlib_root()
    files = list_source_files(root)
    val = [rel for rel in files if is_validation(rel)] or files[-1:]
    candidates: dict[str, list[tuple]] = {k: [] for k in KINDS}
    for rel in val:
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        bodies, docs = _function_candidates(rel, text)
        candidates["function-body"] += bodies
        candidates["docstring"] += docs
        candidates["repetitive"] += _repetitive_candidates(rel, text)
    prompts: list[BenchPrompt] = []
    used_sources: set[str] = set()
    for kind in KINDS:
        taken = 0
        files_used: set[str] = set()
        for _, prompt, source in sorted(candidates[kind]):
            file = source.rsplit(":", 1)[0]
            if file in files_used or source in used_sources:
                continue
            files_used.add(file)
            used_sources.add(source)
            taken += 1
            prompts.append(BenchPrompt(f"{kind}-{taken}", prompt, kind, source))
            if taken >= per_kind:
                break
    # Interleave kinds so any prefix of the list covers every kind.
    by_kind = {k: [p for p in prompts if p.kind == k] for k in KINDS}
    ordered = []
    for i in range(per_kind):
        ordered += [group[i] for group in by_kind.values() if i < len(group)]
    return ordered


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the default benchmark prompt set.")
    parser.add_argument("--out", default=str(DEFAULT_PROMPTS_FILE))
    parser.add_argument("--per-kind", type=int, default=PER_KIND)
    args = parser.parse_args(argv)
    prompts = build_default_prompts(per_kind=args.per_kind)
    save_prompts(prompts, args.out)
    print(f"wrote {len(prompts)} prompts to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
