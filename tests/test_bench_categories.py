"""Prompt categories: short, long (600-1500 tokens, validation split) and out-of-domain
(third-party packages), reported separately and over all categories."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from quickdraft.bench.cli import add_bench_parser
from quickdraft.bench.prompt_sets import (
    KINDS,
    LONG_TOKENS,
    MAX_STDLIB_OVERLAP,
    _significant_lines,
    build_long,
    build_short,
    embedded_continues,
    embedded_token_counter,
    stdlib_lines,
)
from quickdraft.bench.prompts import (
    CATEGORIES,
    BenchPrompt,
    PromptFileError,
    builtin_prompts,
    category_file,
    load_prompts,
    parse_categories,
    save_prompts,
    select,
)


def parse(argv):
    parser = argparse.ArgumentParser(prog="quickdraft")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


@pytest.fixture(scope="module")
def count_tokens():
    return embedded_token_counter()


def test_builtin_categories():
    prompts = builtin_prompts()
    assert [p.category for p in prompts] == sorted((p.category for p in prompts), key=CATEGORIES.index)
    assert {p.category for p in prompts} == set(CATEGORIES)
    assert len({p.id for p in prompts}) == len(prompts)  # ids unique over all categories
    quick = builtin_prompts(per_category=2)
    assert [p.category for p in quick] == ["short", "short", "long", "long", "out-of-domain", "out-of-domain"]
    # quick out-of-domain: one short and one long prompt
    assert {p.size for p in quick if p.category == "out-of-domain"} == {"short", "long"}


def test_long_prompts_are_long_and_held_out(count_tokens):
    from quickdraft.train.corpus import is_validation

    prompts = builtin_prompts(("long",))
    assert len(prompts) >= 6
    for p in prompts:
        n = count_tokens(p.prompt)
        assert LONG_TOKENS[0] <= n <= LONG_TOKENS[1] and p.origin["tokens"] == n, p.id
        assert is_validation(p.source.rsplit(":", 1)[0]), p.source  # never trained on
        assert p.size == "long" and p.kind in ("function-body", "repetitive", "docstring")


def test_out_of_domain_prompts(count_tokens):
    from importlib import metadata

    corpus = stdlib_lines()
    prompts = builtin_prompts(("out-of-domain",))
    assert {p.size for p in prompts} == {"short", "long"}
    assert len({p.origin["package"] for p in prompts}) >= 3
    for p in prompts:
        origin = p.origin
        assert {"package", "version", "file", "license"} <= set(origin), p.id
        assert origin["package"] not in sys.stdlib_module_names
        assert origin["file"].startswith(origin["package"].replace("-", "_") + "/")
        assert origin["license"] and origin["license"] != "unknown"
        n = count_tokens(p.prompt)
        if p.size == "long":
            assert LONG_TOKENS[0] <= n <= LONG_TOKENS[1], p.id
        else:
            assert 60 <= n <= 400, p.id
        lines = _significant_lines(p.prompt)
        assert len(lines & corpus) / max(len(lines), 1) <= MAX_STDLIB_OVERLAP, p.id  # not training text
        try:  # the text is the package's, where that version is installed
            installed = metadata.distribution(origin["package"])
        except metadata.PackageNotFoundError:
            continue
        if installed.version == origin["version"]:
            text = installed.locate_file(origin["file"]).read_text(encoding="utf-8")
            assert p.prompt in text, p.id


def fake_corpus(root, functions: int):
    """Three modules of ``functions`` documented functions and a table each."""
    body = "".join(
        f"def f{i}(x, y):\n    \"\"\"Add x and y ({i}).\"\"\"\n    z = x + y\n    z += {i}\n    w = z * 2\n    return w\n\n"
        for i in range(functions)
    )
    table = "TABLE = {\n" + "".join(f"    'k{i}': {i},\n" for i in range(12)) + "}\n"
    for n in range(3):
        (root / f"mod{n}.py").write_text(body + table)
    return root


def always(text: str) -> bool:  # the embedded target's check, standing in for text it never saw
    return True


def test_build_short_is_deterministic(tmp_path):
    root = fake_corpus(tmp_path, 3)
    a, b = build_short(root, continues=always), build_short(root, continues=always)
    assert a == b and {p.kind for p in a} == set(KINDS) and {p.category for p in a} == {"short"}
    doc = next(p for p in a if p.kind == "docstring")
    assert doc.prompt.endswith('"""')
    fb = next(p for p in a if p.kind == "function-body")
    assert fb.prompt.rstrip().endswith('"""') and "def f" in fb.prompt


def test_build_long_is_deterministic(tmp_path):
    root = fake_corpus(tmp_path, 120)

    def count(text):  # about as many tokens as the real tokenizer gives
        return len(text) // 4

    a = build_long(root, count_tokens=count, continues=always)
    assert a == build_long(root, count_tokens=count, continues=always) and a
    assert all(LONG_TOKENS[0] <= count(p.prompt) <= LONG_TOKENS[1] and p.category == "long" for p in a)
    # a prompt the target would end at once is passed over for the next candidate
    ended = a[0].prompt
    b = build_long(root, count_tokens=count, continues=lambda text: text != ended)
    assert ended not in {p.prompt for p in b} and len(b) == len(a)


def test_the_embedded_target_continues_every_stored_prompt():
    """A prompt the target ends at once has no speedup to measure: the bench's long
    category once measured one prompt, its other (long-repetitive-1, cp865.py's table at
    1,000 tokens) ending at once. The builders now pass such prompts over; the stored ones
    each get at least a token (the full 128 are checked when the files are built)."""
    import encodings

    table = (Path(encodings.__file__).parent / "cp865.py").read_text().splitlines(keepends=True)
    continues = embedded_continues(1)
    assert not continues("".join(table[155:225]))  # the old long-repetitive-1
    for category in ("short", "long", "out-of-domain"):
        for p in load_prompts(category_file(category)):
            assert continues(p.prompt), p.id


def test_category_selection(tmp_path):
    prompts = [BenchPrompt("a", "x = 1\n", category="mine"), BenchPrompt("b", "y = 2\n"),
               BenchPrompt("c", "z = 3\n", category="mine")]
    path = tmp_path / "p.jsonl"
    save_prompts(prompts, path)
    loaded = load_prompts(path)
    assert [p.category for p in loaded] == ["mine", "custom", "mine"]
    assert [p.id for p in select(loaded)] == ["a", "c", "b"]  # grouped by category
    assert [p.id for p in select(loaded, ("mine",), 1)] == ["a"]
    with pytest.raises(PromptFileError, match="no prompts of category 'short'"):
        select(loaded, ("short",))
    assert parse_categories(None) is None
    assert parse_categories("long, short,long") == ("long", "short")
    with pytest.raises(PromptFileError, match="unknown category 'medium'"):
        parse_categories("short,medium")


def test_unknown_category_exits_2(capsys):
    args = parse(["--categories", "short,tiny"])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "unknown category 'tiny'" in err and len(err.strip().splitlines()) == 1


def test_bench_reports_each_category(tiny_family, tmp_path, capsys):
    """The tiny models' context is 256 tokens (their tokenizer splits finely): long prompts
    are cut to their end, the output says so, nothing crashes."""
    out_json = tmp_path / "cat.json"
    args = parse(["--model", str(tiny_family["target"]), "--draft", str(tiny_family["perturbed"]),
                  "--quick", "--methods", "ar,draft", "-k", "2", "--max-new-tokens", "6",
                  "--json", str(out_json), "--quiet"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    result = json.loads(out_json.read_text())
    assert [g["category"] for g in result["results"]] == list(CATEGORIES)
    assert result["overall"]["category"] == "all"
    cfg = result["config"]
    assert cfg["categories"] == list(CATEGORIES) and cfg["context_length"] == 256
    for group in result["results"]:
        assert len(group["prompts"]) == 2 and {r["label"] for r in group["rows"]} == {"ar", "draft k=2"}
        assert all(r["lossless"] for r in group["rows"])
    long_group = result["results"][1]
    assert long_group["truncated_prompts"] == 2
    long_prompts = [p for p in cfg["prompts"] if p["category"] == "long"]
    assert all(p["truncated"] and p["tokens_used"] == cfg["max_prompt_tokens"] < p["tokens"] for p in long_prompts)
    # a table per category, then the headline over all of them
    positions = [out.index(f"{c}: 2 prompts") for c in CATEGORIES]
    assert positions == sorted(positions) and out.index("all categories") > positions[-1]
    assert f"kept their last {cfg['max_prompt_tokens']} tokens" in " ".join(out.split())  # titles wrap
    # overall = the runs of all categories together
    overall = {r["label"]: r for r in result["overall"]["rows"]}
    assert overall["draft k=2"]["spread"]["speedup"]["n"] == 6
    md = (tmp_path / "cat.md").read_text()
    assert "## All categories (headline)" in md and all(f"## {c}: " in md for c in CATEGORIES)
