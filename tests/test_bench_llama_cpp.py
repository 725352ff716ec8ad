"""llama.cpp as a bench baseline: its output parsed (real output captured from llama.cpp's
binaries, tests/llama_cpp_output/), its greedy text compared with our tokens, and clean
errors without its binaries. The end-to-end run needs the binaries: set
$QUICKDRAFT_LLAMA_CPP to their directory (docs/llama_cpp.md)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from quickdraft.bench.cli import add_bench_parser
from quickdraft.bench.config import BenchError
from quickdraft.bench.llama_cpp import (
    ENV_DIR,
    divergence,
    find_binaries,
    greedy_agreement,
    parse_completion,
    parse_speculative,
    token_bytes,
)
from quickdraft.bench.results import RunOutput
from quickdraft.models.registry import ASSETS_DIR
from quickdraft.pair import load_tokenizer

OUTPUT = Path(__file__).parent / "llama_cpp_output"


def parse(argv):
    parser = argparse.ArgumentParser(prog="quickdraft")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ASSETS_DIR / "qd-stdlib-target")


@pytest.mark.parametrize("where, message", [
    ("/nonexistent/llama.cpp", "no such directory"),
    ("EMPTY", "lacks llama-completion, llama-speculative-simple"),
])
def test_missing_binaries_is_one_line_before_loading_anything(where, message, tmp_path, capsys):
    args = parse(["--baseline", "llama.cpp", "--llama-cpp", str(tmp_path) if where == "EMPTY" else where,
                  "--quiet"])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert message in err and "docs/llama_cpp.md" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_find_binaries_wants_executables(tmp_path):
    for name in ("llama-completion", "llama-speculative-simple"):
        (tmp_path / name).write_text("#!/bin/sh\n")
    with pytest.raises(BenchError, match="lacks llama-completion"):
        find_binaries(tmp_path)
    for name in ("llama-completion", "llama-speculative-simple"):
        (tmp_path / name).chmod(0o755)
    assert set(find_binaries(tmp_path)) == {"llama-completion", "llama-speculative-simple"}


def test_sampling_is_refused(tmp_path, capsys):
    for name in ("llama-completion", "llama-speculative-simple"):
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    args = parse(["--baseline", "llama.cpp", "--llama-cpp", str(tmp_path), "--temperature", "0.7", "--quiet"])
    assert args.func(args) == 2
    assert "greedy decoding only" in capsys.readouterr().err


def test_divergence_is_counted_in_our_tokens(tokenizer):
    ids = tokenizer("def parse(self, text):\n    return text.split('é')\n")["input_ids"]
    pieces = token_bytes(tokenizer, ids)
    text = b"".join(pieces)
    assert text.decode() == tokenizer.decode(ids)
    assert divergence(pieces, text) is None
    assert divergence(pieces, text[:-1]) == len(ids) - 1  # stops inside the last token
    assert divergence(pieces, text + b"x") is None  # llama-speculative-simple overshoots
    at = len(pieces[0]) + len(pieces[1])  # the first byte of the third token
    changed = text[:at] + bytes([text[at] ^ 1]) + text[at + 1:]
    assert divergence(pieces, changed) == 2


def test_greedy_agreement_counts_prompts(tokenizer):
    ids = tokenizer("import os\nimport sys\n")["input_ids"]
    pieces = token_bytes(tokenizer, ids)
    text = b"".join(pieces)
    assert len(pieces[1]) > 1

    def run(t):
        out = RunOutput([], 1.0, 1.0)
        out.text = t
        return out

    reference = [[RunOutput(ids, 1.0, 1.0)], [RunOutput(ids, 1.0, 1.0)]]
    result = greedy_agreement([[run(text), run(text)], [run(text), run(text[: len(pieces[0]) + 1])]], reference, tokenizer,
                              ["a", "b"])
    assert result == {"prompts": 2, "agreeing": 1, "first_divergence": {"b": 1}}


PROMPT = "def parse_args(argv=None):\n    parser = argparse.ArgumentParser("


def captured(name: str) -> tuple[bytes, str]:
    return (OUTPUT / f"{name}.stdout").read_bytes(), (OUTPUT / f"{name}.stderr").read_text()


def test_parse_real_completion_output(tokenizer):
    run = parse_completion(*captured("completion"))
    assert run.tokens == 32 and run.passes == 32  # -n 32: 31 evaluated after the prompt pass
    assert run.decode_seconds == pytest.approx((2474.31 + 1.91) / 1e3)
    assert run.prompt_seconds == pytest.approx(1.12732)
    assert run.text.startswith(b"self.name, 'name', ") and not run.text.endswith(b"\n\n")
    assert run.prompt_ids == tokenizer(PROMPT)["input_ids"]  # llama.cpp's tokenizer is ours


def test_parse_real_speculative_output(tokenizer):
    stdout, stderr = captured("speculative")
    run = parse_speculative(stdout, stderr, PROMPT.encode(), 32)
    assert (run.tokens, run.drafted, run.accepted, run.passes) == (39, 40, 34, 5)
    assert run.decode_seconds == pytest.approx(0.575) and run.prompt_seconds == pytest.approx(0.101)
    plain = parse_completion(*captured("completion"))
    assert run.text.startswith(plain.text)  # both greedy: the same text, spec a few tokens longer
    with pytest.raises(BenchError, match="echo the prompt"):
        parse_speculative(stdout, stderr, b"another prompt", 32)
    with pytest.raises(BenchError, match="decoded"):
        parse_speculative(stdout, "", PROMPT.encode(), 32)


@pytest.mark.skipif(not os.environ.get(ENV_DIR), reason=f"set ${ENV_DIR} to llama.cpp's binaries (docs/llama_cpp.md)")
def test_bench_with_llama_cpp_end_to_end(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = parse(["--baseline", "llama.cpp", "--methods", "ar,draft", "--categories", "short", "--quick",
                  "--max-new-tokens", "24", "-k", "4", "--llama-cpp-draft-max", "4", "--json", str(out), "--quiet"])
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    rows = {r["label"]: r for r in result["overall"]["rows"]}
    assert {"llama.cpp", "llama.cpp-spec k=4"} <= set(rows)
    checked = result["llama_cpp"]["prompt_ids_equal"]
    assert len(checked) == 2 and all(checked.values())  # llama.cpp tokenized both prompts as we do
    for label in ("llama.cpp", "llama.cpp-spec k=4"):
        assert rows[label]["tokens_per_second"] > 0 and rows[label]["greedy_agreement"]["prompts"] == 2
    assert 0 < rows["llama.cpp-spec k=4"]["acceptance_rate"] <= 1
    assert "agree" in capsys.readouterr().out


def test_llama_cpp_rows_take_our_kv_cache_type(tmp_path):
    """Like for like: llama.cpp's caches (target and draft) are f32, or f16 beside our
    ``--kv-cache float16``, and the run's JSON says which."""
    from quickdraft.bench.llama_cpp import PLAIN, SPECULATIVE, LlamaCppMethod, LlamaCppSetup

    for ours, theirs in (("auto", "f32"), ("float16", "f16")):
        setup = LlamaCppSetup({PLAIN: tmp_path / "c", SPECULATIVE: tmp_path / "s"}, tmp_path / "t.gguf",
                              tmp_path / "d.gguf", 2, kv_cache="f16" if ours == "float16" else "f32")
        for row in (LlamaCppMethod(setup), LlamaCppMethod(setup, 4)):
            cmd = row.command("x", 8, 64, 0)
            types = [cmd[i + 1] for i, flag in enumerate(cmd) if flag in ("-ctk", "-ctv", "-ctkd", "-ctvd")]
            assert types and set(types) == {theirs}, (ours, row.label)
        assert setup.to_json()["kv_cache"] == theirs
