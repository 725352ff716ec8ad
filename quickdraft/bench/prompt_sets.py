"""Building the built-in prompt categories (the stored files in ``quickdraft/assets/bench/``).

Every prompt ends where a model has real work to do:

- ``function-body``: the context before a function, its signature and docstring; the
  model writes the body;
- ``repetitive``: the start of a run of same-shaped lines (tables, constant lists,
  registration calls); the model continues the pattern;
- ``docstring``: the context, a signature and an opening ``\"\"\"``; the model writes the
  docstring.

The context before that point is as many whole lines as fit a budget: about 420
characters (~120 tokens) for short prompts, 600-1500 tokens (counted with the embedded
target's tokenizer; the target length is drawn per prompt from a hash) for long ones.
A candidate the embedded target ends within its first 128 greedy tokens is passed over
(:func:`embedded_continues`): the bench's ratios are per prompt, and a prompt with no new
tokens has none.

Sources:

- ``short`` and ``long``: the validation split of the training corpus
  (:mod:`quickdraft.train.corpus`: the stdlib ``.py`` files whose path hash falls in the
  validation fraction), so the models never trained on these prompts;
- ``out-of-domain``: third-party packages installed beside quickdraft
  (:data:`OOD_PACKAGES`), never part of the corpus; a candidate is dropped when more than
  :data:`MAX_STDLIB_OVERLAP` of its longer lines also occur in the stdlib. Each prompt
  records the package, its version, the file and the package's licence.

Everything is deterministic: candidates are ordered by a hash of their kind and source
location, and at most one prompt per file per kind is taken. The stdlib and the packages
differ between installs, so the stored files are what ``quickdraft bench`` uses; rebuild
them with ``python -m quickdraft.bench.prompt_sets`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import platform
import re
from collections.abc import Callable
from pathlib import Path

from ..sources import OOD_PACKAGES, package_files, package_license
from .prompts import CATEGORIES, BenchPrompt, category_file, save_prompts

KINDS = ("function-body", "repetitive", "docstring")
MAX_PROMPT_CHARS = 420  # short prompts: ~120 tokens of context
LONG_TOKENS = (600, 1500)  # long prompts: this many tokens, with the embedded tokenizer
CHARS_PER_TOKEN = 3.6  # first guess of a long prompt's character budget (then counted exactly)
OOD_FILES_PER_PACKAGE = 60  # files read per package (the first by path hash)
MAX_STDLIB_OVERLAP = 0.1
PER_KIND = {"short": 4, "long": 3, "out-of-domain": 2}  # per kind (out-of-domain: per kind and size)
CONTINUATION_TOKENS = 128  # the embedded target must write this many without ending (the bench's default)

Candidate = tuple[str, str, str]  # (sort key, prompt, source)


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


def _function_candidates(rel: str, text: str, budget: Callable[[str], int]) -> tuple[list, list]:
    """(function-body, docstring) candidates of one file. ``budget(source)`` is the prompt's
    size in characters."""
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
        size = budget(source)
        # function-body: signature + docstring, then the body
        if len(header) + len(doc_text) <= MAX_PROMPT_CHARS - 40:
            ctx = _context_before(lines, node.lineno - 1, size - len(header) - len(doc_text))
            bodies.append((_key("body", source), ctx + header + doc_text, source))
        # docstring: signature + the opening quotes of the docstring
        opening = re.match(r"\s*(?:[rRuU]?)(\"\"\"|''')", lines[first.lineno - 1])
        if opening and len(header) <= MAX_PROMPT_CHARS - 40:
            start = lines[first.lineno - 1][: opening.end()]
            ctx = _context_before(lines, node.lineno - 1, size - len(header) - len(start))
            docs.append((_key("doc", source), ctx + header + start, source))
    return bodies, docs


_SHAPE = re.compile(r"^(\s*)([A-Za-z_][\w.]*|'|\"|\(|\[|\{|[0-9])")


def _repetitive_candidates(rel: str, text: str, budget: Callable[[str], int], min_run: int = 8,
                           shown: int = 5) -> list[Candidate]:
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
                source = f"{rel}:{i + 1}"
                ctx = _context_before(lines, i, budget(source) - len(head))
                out.append((_key("rep", source), ctx + head, source))
        i = j + 1
    return out


def _candidates(rel: str, text: str, budget: Callable[[str], int]) -> dict[str, list[Candidate]]:
    bodies, docs = _function_candidates(rel, text, budget)
    return {"function-body": bodies, "docstring": docs,
            "repetitive": _repetitive_candidates(rel, text, budget)}


def _short_budget(source: str) -> int:
    return MAX_PROMPT_CHARS


def _long_budget(source: str) -> int:
    """Characters for a long prompt: a target token count drawn from the source's hash."""
    lo, hi = LONG_TOKENS
    target = lo + 50 + int(_key("long", source)[:8], 16) % (hi - lo - 100)
    return int(target * CHARS_PER_TOKEN)


def embedded_token_counter() -> Callable[[str], int]:
    """Token counts with the embedded default target's tokenizer."""
    from ..models.registry import default_target
    from ..pair import load_tokenizer

    target = default_target()
    if target is None:
        raise RuntimeError("no embedded model is installed: long prompts are measured with its tokenizer")
    tokenizer = load_tokenizer(target.path)
    tokenizer.model_max_length = 1 << 30  # counting only: no "longer than the maximum" warning
    return lambda text: len(tokenizer(text)["input_ids"])


def embedded_continues(max_new_tokens: int = CONTINUATION_TOKENS) -> Callable[[str], bool]:
    """Whether the embedded default target, decoding greedily, writes ``max_new_tokens``
    tokens after a prompt without ending: a prompt it ends at once measures nothing (the
    bench's speedups are per prompt; 0 tokens is no ratio)."""
    from ..generator import SpeculativeGenerator

    generator = SpeculativeGenerator.from_pretrained(method="ar")
    return lambda text: generator.generate(text, max_new_tokens=max_new_tokens).stats.new_tokens >= max_new_tokens


def _pick(candidates: dict[str, list[Candidate]], per_kind: int, used_sources: set[str],
          accept: Callable[[str, str], bool] = lambda prompt, source: True) -> dict[str, list[Candidate]]:
    """Up to ``per_kind`` candidates per kind, in key order, one per file per kind, each
    source once, keeping those ``accept`` takes."""
    out: dict[str, list[Candidate]] = {}
    for kind in KINDS:
        taken: list[Candidate] = []
        files_used: set[str] = set()
        for cand in sorted(candidates.get(kind, [])):
            _, prompt, source = cand
            file = source.rsplit(":", 1)[0]
            if file in files_used or source in used_sources or not accept(prompt, source):
                continue
            files_used.add(file)
            used_sources.add(source)
            taken.append(cand)
            if len(taken) >= per_kind:
                break
        out[kind] = taken
    return out


def _interleave(groups: list[list[BenchPrompt]]) -> list[BenchPrompt]:
    """Round-robin over groups, so any prefix of the list covers every group."""
    out = []
    for i in range(max((len(g) for g in groups), default=0)):
        out += [g[i] for g in groups if i < len(g)]
    return out


def _validation_files(root: Path | None, code_only: bool = False) -> tuple[Path, list[str]]:
    """The corpus root and its validation files (``code_only``: without ``pydoc_data/``,
    generated documentation text in a Python file)."""
    from ..train.corpus import is_validation, list_source_files, stdlib_root

    root = Path(root) if root is not None else stdlib_root()
    files = list_source_files(root)
    val = [rel for rel in files if is_validation(rel) and not (code_only and rel.startswith("pydoc_data/"))]
    return root, val or files[-1:]


def _read(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def build_short(root: Path | None = None, per_kind: int = PER_KIND["short"],
                continues: Callable[[str], bool] | None = None) -> list[BenchPrompt]:
    """The ``short`` category: up to ~420 characters of context, from the validation split of
    the corpus under ``root`` (default: this interpreter's stdlib), each one the embedded
    target continues (``continues``, default :func:`embedded_continues`)."""
    continues = continues or embedded_continues()
    root, val = _validation_files(root)
    candidates: dict[str, list[Candidate]] = {k: [] for k in KINDS}
    for rel in val:
        text = _read(root / rel)
        for kind, found in ({} if text is None else _candidates(rel, text, _short_budget)).items():
            candidates[kind] += found
    picked = _pick(candidates, per_kind, set(), accept=lambda prompt, source: continues(prompt))
    return _interleave([[BenchPrompt(f"{kind}-{i}", prompt, kind, source, "short")
                         for i, (_, prompt, source) in enumerate(picked[kind], 1)] for kind in KINDS])


def build_long(root: Path | None = None, per_kind: int = PER_KIND["long"],
               count_tokens: Callable[[str], int] | None = None,
               exclude_sources: set[str] | None = None,
               continues: Callable[[str], bool] | None = None) -> list[BenchPrompt]:
    """The ``long`` category: 600-1500 tokens of context from the validation split (sources
    in ``exclude_sources``, e.g. those of the short set, are not used again), each one the
    embedded target continues (``continues``, default :func:`embedded_continues`)."""
    count_tokens = count_tokens or embedded_token_counter()
    continues = continues or embedded_continues()
    root, val = _validation_files(root, code_only=True)
    candidates: dict[str, list[Candidate]] = {k: [] for k in KINDS}
    for rel in val:
        text = _read(root / rel)
        for kind, found in ({} if text is None else _candidates(rel, text, _long_budget)).items():
            candidates[kind] += found
    lo, hi = LONG_TOKENS
    picked = _pick(candidates, per_kind, set(exclude_sources or ()),
                   accept=lambda prompt, source: lo <= count_tokens(prompt) <= hi and continues(prompt))
    origin = {"corpus": "stdlib validation split (quickdraft.train.corpus)", "python": platform.python_version()}
    return _interleave([[BenchPrompt(f"long-{kind}-{i}", prompt, kind, source, "long", "long",
                                     {**origin, "file": source.rsplit(":", 1)[0], "tokens": count_tokens(prompt)})
                         for i, (_, prompt, source) in enumerate(picked[kind], 1)] for kind in KINDS])


# --- out-of-domain ----------------------------------------------------------------------------


def _significant_lines(text: str) -> set[str]:
    return {s for s in (line.strip() for line in text.splitlines()) if len(s) >= 30}


def stdlib_lines(root: Path | None = None) -> set[str]:
    """Every longer line (stripped, >= 30 characters) of the whole training corpus."""
    from ..train.corpus import list_source_files, stdlib_root

    root = Path(root) if root is not None else stdlib_root()
    lines: set[str] = set()
    for rel in list_source_files(root):
        text = _read(root / rel)
        if text:
            lines |= _significant_lines(text)
    return lines


def build_out_of_domain(packages: tuple[str, ...] = OOD_PACKAGES, per_kind: int = PER_KIND["out-of-domain"],
                        count_tokens: Callable[[str], int] | None = None,
                        corpus_lines: set[str] | None = None,
                        files_per_package: int = OOD_FILES_PER_PACKAGE,
                        continues: Callable[[str], bool] | None = None) -> list[BenchPrompt]:
    """The ``out-of-domain`` category: short and long prompts from installed third-party
    packages, each one the embedded target continues (``continues``, default
    :func:`embedded_continues`). Packages are used in turn, so the prompts spread over all
    of them."""
    from importlib import metadata

    count_tokens = count_tokens or embedded_token_counter()
    continues = continues or embedded_continues()
    corpus_lines = stdlib_lines() if corpus_lines is None else corpus_lines
    lo, hi = LONG_TOKENS
    sizes = {"short": (_short_budget, lambda n: True), "long": (_long_budget, lambda n: lo <= n <= hi)}
    # per (size, kind): one candidate list per package
    found: dict[tuple[str, str], dict[str, list[Candidate]]] = {}
    origins: dict[str, dict] = {}
    for package in packages:
        try:
            dist = metadata.distribution(package)
        except metadata.PackageNotFoundError:
            continue
        info = {"package": package, "version": dist.version, "license": package_license(dist)}
        for rel, path in package_files(dist, package)[:files_per_package]:
            text = _read(path)
            if not text:
                continue
            origins[rel] = {**info, "file": rel}
            for size, (budget, _) in sizes.items():
                for kind, cands in _candidates(rel, text, budget).items():
                    found.setdefault((size, kind), {}).setdefault(package, []).extend(cands)

    def in_domain(prompt: str) -> bool:
        lines = _significant_lines(prompt)
        return bool(lines) and len(lines & corpus_lines) / len(lines) > MAX_STDLIB_OVERLAP

    used: set[str] = set()
    groups: list[list[BenchPrompt]] = []
    turn = 0
    for kind in KINDS:
        for size, (_, fits) in sizes.items():
            by_package = found.get((size, kind), {})
            names = [p for p in packages if by_package.get(p)]
            group: list[BenchPrompt] = []
            files_used: set[str] = set()
            tries = 0
            while len(group) < per_kind and names and tries < 4 * len(names):
                package = names[turn % len(names)]
                turn += 1
                tries += 1
                for _, prompt, source in sorted(by_package[package]):
                    file = source.rsplit(":", 1)[0]
                    if source in used or file in files_used or in_domain(prompt):
                        continue
                    n = count_tokens(prompt)
                    if not fits(n) or not continues(prompt):
                        continue
                    used.add(source)
                    files_used.add(file)
                    origin = {**origins[file], "line": int(source.rsplit(":", 1)[1]), "tokens": n}
                    group.append(BenchPrompt(f"ood-{size}-{kind}-{len(group) + 1}", prompt, kind,
                                             f"{package} {origin['version']}: {source}", "out-of-domain",
                                             size, origin))
                    break
            groups.append(group)
    return _interleave(groups)


def build_category(category: str, **kwargs) -> list[BenchPrompt]:
    """Build one built-in category (keyword arguments go to its builder)."""
    if category == "short":
        return build_short(**kwargs)
    if category == "long":
        short_sources = set()
        if category_file("short").is_file():
            from .prompts import load_prompts

            short_sources = {p.source for p in load_prompts(category_file("short"))}
        return build_long(exclude_sources=short_sources, **kwargs)
    if category == "out-of-domain":
        return build_out_of_domain(**kwargs)
    if category == "code":
        return build_code(**kwargs)
    if category == "chat":
        raise ValueError("the chat prompts are written by hand (quickdraft/assets/bench/chat.jsonl); edit that file")
    raise ValueError(f"unknown category {category!r}; choose from: {', '.join(CATEGORIES)}, code")


CODE_KINDS = ("function-body", "docstring")


def build_code() -> list[BenchPrompt]:
    """The ``code`` category (completions for an instruct model): the stored short
    function-body and docstring prompts of ``short`` and ``out-of-domain``, renamed. Same
    text and sources, so they stay out of every training split as those do."""
    from dataclasses import replace

    from .prompts import load_prompts

    out = []
    for category, suffix in (("short", ""), ("out-of-domain", "-ood")):
        for p in load_prompts(category_file(category)):
            if p.kind in CODE_KINDS and p.size in ("", "short"):
                out.append(replace(p, id=f"code-{p.id.removeprefix('ood-short-')}{suffix}", category="code", size=""))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the built-in benchmark prompt categories.")
    parser.add_argument("--categories", default=",".join(CATEGORIES),
                        help=f"comma-separated (default: {','.join(CATEGORIES)})")
    parser.add_argument("--out-dir", help="write CATEGORY.jsonl here (default: the package's assets)")
    args = parser.parse_args(argv)
    for category in (c.strip() for c in args.categories.split(",") if c.strip()):
        prompts = build_category(category)
        out = Path(args.out_dir) / f"{category}.jsonl" if args.out_dir else category_file(category)
        save_prompts(prompts, out)
        print(f"wrote {len(prompts)} {category} prompts to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
