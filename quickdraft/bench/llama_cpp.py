"""llama.cpp as a benchmark baseline (``quickdraft bench --baseline llama.cpp --llama-cpp DIR``).

Rows ``llama.cpp`` (``llama-completion``, plain greedy decoding) and ``llama.cpp-spec``
(``llama-speculative-simple`` with the same draft, one row per ``--spec-draft-n-max``) run
llama.cpp's own binaries, one process per generation, on the same prompts, the same
weights (our checkpoints exported to f32 GGUF by :mod:`quickdraft.models.gguf_export`; a
GGUF target as it is), the same threads and KV cache type (f32, or f16 with
``--kv-cache float16``), alternating with our rows like any other. Their timings are
llama.cpp's own (process start and model load excluded):

- tokens/s = generated tokens / decode seconds, as for our rows. Plain: llama.cpp's eval
  time plus its sampling time (the first token comes from the prompt pass, as ours does).
  Speculative: its decode loop's wall time (which also holds the last prompt token's pass).
- tau = tokens per target pass after the prompt; acceptance = accepted / drafted tokens.

llama.cpp prints text, not token ids, so agreement with our ``ar`` is checked on the
bytes: a prompt agrees when llama.cpp's text is the text of our tokens, and diverges at
the first of our tokens whose bytes it does not continue (:func:`greedy_agreement`). The
prompt's token ids are checked against ours on every plain run (``--verbose-prompt``).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import BenchError
from .results import RunOutput

PLAIN, SPECULATIVE = "llama-completion", "llama-speculative-simple"
BINARIES = (PLAIN, SPECULATIVE)
#: Where ``--llama-cpp`` defaults from (and what the tests that need the binaries read).
ENV_DIR = "QUICKDRAFT_LLAMA_CPP"
DEFAULT_DRAFT_MAX = (4, 8, 12)
TIMEOUT_S = 300
ATTEMPTS = 5  # runs of one generation whose output lost its last lines (see LlamaCppMethod.run)
BUILD_HINT = ("build llama.cpp's targets llama-completion and llama-speculative-simple (docs/llama_cpp.md) "
              "and pass their directory, e.g. --llama-cpp ~/llama.cpp/build/bin")


def find_binaries(directory: str | os.PathLike | None) -> dict[str, Path]:
    """The llama.cpp binaries in ``directory``; :class:`BenchError` (one line) naming what
    to build when it lacks them."""
    if not directory:
        raise BenchError(f"--baseline llama.cpp needs --llama-cpp DIR (or ${ENV_DIR}): {BUILD_HINT}")
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise BenchError(f"--llama-cpp {directory}: no such directory; {BUILD_HINT}")
    found = {name: root / name for name in BINARIES}
    missing = [name for name, path in found.items() if not (path.is_file() and os.access(path, os.X_OK))]
    if missing:
        raise BenchError(f"--llama-cpp {directory} lacks {', '.join(missing)}; {BUILD_HINT}")
    return found


# --- parsing llama.cpp's output -------------------------------------------------------------

@dataclass
class LlamaCppRun:
    """What one llama.cpp process reported."""

    text: bytes  # the generated text (the end-of-generation token prints nothing)
    tokens: int | None  # generated tokens, the end-of-generation token left out (None: unknown)
    decode_seconds: float
    prompt_seconds: float
    passes: int | None = None  # target passes after the prompt
    drafted: int | None = None
    accepted: int | None = None
    prompt_ids: list[int] | None = None  # as llama.cpp tokenized the prompt (--verbose-prompt)


# Log lines may carry a timestamp and level prefix ("0.03.807.601 I "): no anchors but the
# token lines'.
_NUMBER = r"([0-9.]+)"
_EVAL = re.compile(rf"(?<!prompt )eval time =\s+{_NUMBER} ms /\s+(\d+) runs")
_PROMPT_EVAL = re.compile(rf"prompt eval time =\s+{_NUMBER} ms /\s+(\d+) tokens")
_SAMPLING = re.compile(rf"sampling time =\s+{_NUMBER} ms")
_PROMPT_COUNT = re.compile(r"number of tokens in prompt = (\d+)")
_PROMPT_TOKEN = re.compile(r"^(?:[0-9.]+ [A-Z] )?\s*(\d+) -> '", re.MULTILINE)
_ENCODED = re.compile(rf"encoded\s+(\d+) tokens in\s+{_NUMBER} seconds")
_DECODED = re.compile(rf"decoded\s+(\d+) tokens in\s+{_NUMBER} seconds")
_COUNTS = {key: re.compile(rf"\b{key}\s+= (\d+)") for key in ("n_predict", "n_drafted", "n_accept")}
END_OF_TEXT = b" [end of text]\n"


def _search(pattern: re.Pattern, text: str, what: str) -> re.Match:
    found = pattern.search(text)
    if found is None:
        raise BenchError(f"llama.cpp's output lacks its {what} line; is it the version docs/llama_cpp.md names?")
    return found


def parse_prompt_ids(stderr: str) -> list[int] | None:
    """The prompt's token ids ``--verbose-prompt`` printed (None without them)."""
    count = _PROMPT_COUNT.search(stderr)
    if count is None:
        return None
    ids = [int(m.group(1)) for m in _PROMPT_TOKEN.finditer(stderr, count.end())]
    return ids[: int(count.group(1))]


def parse_completion(stdout: bytes, stderr: str) -> LlamaCppRun:
    """``llama-completion --no-display-prompt``: stdout is the generated text, then
    `` [end of text]`` if it ended on its end-of-generation token, then a blank line."""
    text = stdout.removesuffix(b"\n\n")
    ended = text.endswith(END_OF_TEXT)
    text = text.removesuffix(END_OF_TEXT)
    evals = _search(_EVAL, stderr, "eval time")
    prompt = _search(_PROMPT_EVAL, stderr, "prompt eval time")
    sampling = _search(_SAMPLING, stderr, "sampling time")
    runs = int(evals.group(2))
    # every generated token but the last is evaluated; an end-of-generation token is the
    # last one sampled and is not part of the output
    tokens = runs if ended else runs + 1
    return LlamaCppRun(text, tokens, (float(evals.group(1)) + float(sampling.group(1))) / 1e3,
                       float(prompt.group(1)) / 1e3, passes=tokens, prompt_ids=parse_prompt_ids(stderr))


def parse_speculative(stdout: bytes, stderr: str, prompt: bytes, max_new_tokens: int) -> LlamaCppRun:
    """``llama-speculative-simple``: stdout is a blank line, the prompt, the generated text
    and a blank line; stderr has the timings and the draft counts."""
    head = b"\n\n" + prompt
    if not stdout.startswith(head):
        raise BenchError("llama-speculative-simple did not echo the prompt as given; its output cannot be "
                         "aligned with the prompt")
    text = stdout[len(head):].removesuffix(b"\n\n")
    decoded = _search(_DECODED, stderr, "decoded")
    encoded = _search(_ENCODED, stderr, "encoded")
    counts = {key: int(_search(p, stderr, key).group(1)) for key, p in _COUNTS.items()}
    predicted, accepted = counts["n_predict"], counts["n_accept"]
    # Without an end-of-generation token it stops once past -n, the last pass's accepted
    # draft included (up to k tokens more than asked: measured, 39 for -n 31 at k=8). With
    # one, n_predict also counts it and the accepted tokens after it, which print nothing:
    # the run's tokens are then unknown here (None; the caller counts the text's).
    tokens = predicted if predicted >= max_new_tokens else None
    return LlamaCppRun(text, tokens, float(decoded.group(2)), float(encoded.group(2)),
                       passes=predicted - accepted, drafted=counts["n_drafted"], accepted=accepted)


# --- greedy agreement with our ar -------------------------------------------------------------

def token_bytes(tokenizer, ids: list[int]) -> list[bytes]:
    """The bytes of each token of a byte-level BPE tokenizer (special tokens: their text)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    out = []
    for piece in tokenizer.convert_ids_to_tokens(ids):
        if all(c in to_byte for c in piece):
            out.append(bytes(to_byte[c] for c in piece))
        else:
            out.append(piece.encode())
    return out


def divergence(reference: list[bytes], text: bytes) -> int | None:
    """None when ``text`` begins with the reference tokens' bytes (llama-speculative-simple
    may generate a few tokens more), else the index of the first reference token ``text``
    does not continue."""
    if text.startswith(b"".join(reference)):
        return None
    at = 0
    for i, piece in enumerate(reference):
        if text[at : at + len(piece)] != piece:
            return i
        at += len(piece)
    return len(reference)


def greedy_agreement(runs: list[list[RunOutput]], reference: list[list[RunOutput]], tokenizer,
                     prompt_ids: list[str]) -> dict:
    """How llama.cpp's greedy output compares with our ``ar`` output, per prompt: agreeing
    prompts, and where the others first diverge (a token index of ours; the earliest over
    the repeats)."""
    diverged: dict[str, int] = {}
    for pid, per, ref in zip(prompt_ids, runs, reference, strict=True):
        pieces = token_bytes(tokenizer, ref[0].tokens)
        where = [d for o in per if (d := divergence(pieces, getattr(o, "text", b""))) is not None]
        if where:
            diverged[pid] = min(where)
    return {"prompts": len(prompt_ids), "agreeing": len(prompt_ids) - len(diverged),
            "first_divergence": diverged}


# --- the rows ---------------------------------------------------------------------------------

@dataclass
class LlamaRunOutput(RunOutput):
    """A llama.cpp run: ``tokens`` are our tokenizer's ids of its text (for display),
    ``generated`` its own token count, ``text`` its bytes."""

    text: bytes = b""
    generated: int = 0

    @property
    def new_tokens(self) -> int:
        return self.generated


@dataclass
class LlamaCppSetup:
    """What every llama.cpp row of a run shares: binaries, GGUF files, threads, and what the
    prompt checks found."""

    binaries: dict[str, Path]
    target_gguf: Path
    draft_gguf: Path | None
    threads: int
    version: str = ""
    prompt_ids_equal: dict[str, bool] = field(default_factory=dict)
    kv_cache: str = "f32"  # llama.cpp's cache type, as ours: f32, or f16 with --kv-cache float16

    def to_json(self) -> dict:
        return {"binaries": {k: str(v) for k, v in self.binaries.items()}, "version": self.version,
                "target_gguf": str(self.target_gguf), "draft_gguf": str(self.draft_gguf) if self.draft_gguf else None,
                "threads": self.threads, "kv_cache": self.kv_cache,
                "prompt_ids_equal": self.prompt_ids_equal}


def _version(binary: Path) -> str:
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    found = re.search(r"version: .*", done.stdout + done.stderr)
    return found.group(0) if found else "unknown"


def gguf_of(path: Path, shared=None, head_ids=None) -> Path:
    """A checkpoint as a GGUF file llama.cpp reads: a ``.gguf`` as it is, else our export."""
    from ..models.gguf import is_gguf
    from ..models.gguf_export import cached_export

    if is_gguf(path):
        return Path(path)
    try:
        return cached_export(Path(path), shared=shared, head_ids=head_ids)
    except ValueError as exc:  # CheckpointError: not exportable
        raise BenchError(f"llama.cpp baseline: {exc}") from None


def setup(ctx, config, need_draft: bool) -> LlamaCppSetup:
    """Find the binaries and the GGUF files of the pair (exported once, cached); kept on
    the context for all llama.cpp rows."""
    if ctx.llama_cpp is None:
        binaries = find_binaries(config.llama_cpp)
        ctx.llama_cpp = LlamaCppSetup(binaries, gguf_of(ctx.target_dir), None, config.threads or 2,
                                      _version(binaries[PLAIN]),
                                      kv_cache="f16" if config.kv_cache == "float16" else "f32")
    if need_draft and ctx.llama_cpp.draft_gguf is None:  # filled in place: the plain row shares it
        if ctx.draft is None:
            raise BenchError("llama.cpp-spec needs a draft model; pass --draft PATH")
        from ..models.draft_vocab import read_draft_vocab
        from ..models.shared_embed import shared_tensors

        head_ids = None if ctx.draft_dir.suffix == ".gguf" else read_draft_vocab(ctx.draft_dir, config.draft_vocab)
        ctx.llama_cpp.draft_gguf = gguf_of(ctx.draft_dir, shared_tensors(ctx.draft_dir, ctx.target), head_ids)
    return ctx.llama_cpp


class LlamaCppMethod:
    """A llama.cpp row: plain (``draft_max`` None) or speculative with the same draft,
    drafting up to ``draft_max`` tokens a step (``--spec-draft-n-max``, no minimum, no
    probability cut-off: a fixed-length chain like our ``draft``)."""

    kind = "llama.cpp"

    def __init__(self, setup: LlamaCppSetup, draft_max: int | None = None) -> None:
        self.setup = setup
        self.k = draft_max
        self.name = "llama.cpp-spec" if draft_max else "llama.cpp"
        self.settings = {"k": draft_max} if draft_max else {}
        self.speculative = draft_max is not None

    @property
    def label(self) -> str:
        return self.name + (f" k={self.k}" if self.k else "")

    def command(self, prompt: str, max_new_tokens: int, context: int, seed: int) -> list[str]:
        s = self.setup
        threads, kv = str(s.threads), s.kv_cache
        common = ["-m", str(s.target_gguf), "-p", prompt, "--no-escape", "-t", threads, "-tb", threads,
                  "-c", str(context), "-b", str(context), "-ctk", kv, "-ctv", kv,
                  "--temp", "0", "--seed", str(seed)]
        if not self.k:
            return [str(s.binaries[PLAIN]), *common, "-n", str(max_new_tokens), "-no-cnv",
                    "--no-display-prompt", "--verbose-prompt"]
        return [str(s.binaries[SPECULATIVE]), *common, "-md", str(s.draft_gguf),
                "-td", threads, "-tbd", threads, "-ctkd", kv, "-ctvd", kv,
                "--spec-type", "draft-simple", "--spec-draft-n-max", str(self.k), "--spec-draft-n-min", "0",
                "--spec-draft-p-min", "0",
                # it generates one token more than -n asks
                "-n", str(max(max_new_tokens - 1, 1))]

    def run(self, ctx, prompt, max_new_tokens, params, prompt_key=""):
        if not params.greedy:
            raise BenchError("the llama.cpp baseline runs greedy decoding only; drop --temperature")
        ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        text = ctx.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        context = len(ids) + max_new_tokens + (self.k or 0) + 8
        cmd = self.command(text, max_new_tokens, context, params.seed or 0)
        # llama.cpp logs from a thread it does not join at exit, so a process sometimes ends
        # before its last lines are written (seen about one run in three here; llama.cpp
        # issue 22142): run again, the output is deterministic.
        for attempt in range(ATTEMPTS):
            done, stderr = self._spawn(cmd, prompt_key)
            try:
                out = (parse_speculative(done.stdout, stderr, text.encode(), max_new_tokens) if self.k
                       else parse_completion(done.stdout, stderr))
                break
            except BenchError as exc:
                if attempt + 1 < ATTEMPTS:
                    continue
                kept = Path(tempfile.mkdtemp(prefix="quickdraft-llama-cpp-"))  # for a bug report
                (kept / "stdout").write_bytes(done.stdout)
                (kept / "stderr").write_text(stderr)
                (kept / "command").write_text(shlex.join(cmd))
                raise BenchError(f"{exc} (its output is in {kept})") from None
        if not self.k and out.prompt_ids is not None and not prompt_key.startswith("warm-up:"):
            self.setup.prompt_ids_equal[prompt_key] = out.prompt_ids == ids
        ours = ctx.tokenizer(out.text.decode(errors="replace"))["input_ids"]
        return LlamaRunOutput(ours, out.decode_seconds, out.prompt_seconds + out.decode_seconds, None,
                              target_passes=out.passes, draft_passes=out.drafted,
                              text=out.text, generated=len(ours) if out.tokens is None else out.tokens)

    @staticmethod
    def _spawn(cmd: list[str], prompt_key: str) -> tuple[subprocess.CompletedProcess, str]:
        try:
            done = subprocess.run(cmd, capture_output=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise BenchError(f"{Path(cmd[0]).name} ran over {TIMEOUT_S} s on prompt {prompt_key}") from None
        stderr = done.stderr.decode(errors="replace")
        if done.returncode != 0:
            last = (stderr.strip().splitlines() or ["no output"])[-1]
            raise BenchError(f"{Path(cmd[0]).name} failed (exit {done.returncode}): {last[:200]}")
        return done, stderr


def plain_rows(ctx, config, k) -> list[LlamaCppMethod]:
    return [LlamaCppMethod(setup(ctx, config, need_draft=False))]


def speculative_rows(ctx, config, k) -> list[LlamaCppMethod]:
    s = setup(ctx, config, need_draft=True)
    return [LlamaCppMethod(s, n) for n in config.llama_cpp_draft_max]


def check_before_loading(config) -> None:
    """Refuse a run with llama.cpp rows that cannot work, before any model loads."""
    if any(m.startswith("llama.cpp") for m in config.methods):
        find_binaries(config.llama_cpp)
        if config.temperature:
            raise BenchError("the llama.cpp baseline runs greedy decoding only; drop --temperature")


def which(directory: str | None) -> str | None:
    """``--llama-cpp``'s default: ``$QUICKDRAFT_LLAMA_CPP``, else the directory of a
    ``llama-completion`` on PATH."""
    if directory:
        return directory
    if os.environ.get(ENV_DIR):
        return os.environ[ENV_DIR]
    found = shutil.which(PLAIN)
    return str(Path(found).parent) if found else None

