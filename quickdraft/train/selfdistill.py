"""``quickdraft train data``: the target writes its own training data (self-distillation).

A draft learns what the target *does*, so the best text to train it on is the target's
own output. Each job is one of:

- ``chat``: a built-in instruction (:mod:`.instructions`) through the target's chat
  template, answered by the target;
- ``self-instruct``: the target writes an instruction from a seed request, then answers it
  (two documents);
- ``code``: a cut of a stdlib file (the corpus' train split, never a file a bench prompt
  comes from) that the target continues.

Which instruction a chat job asks (``instructions``): a new directory walks the
:func:`~.instructions.catalogue` of distinct instructions, its n-th chat job asking the
n-th (round again when sampled; at temperature 0 an instruction always gets the same
answer, so a greedy directory's chat jobs past the end are self-instruct jobs). Older
directories (no ``instructions`` in their record) keep the first plan, ``cycle``: job
``j`` asks :func:`~.instructions.instruction` ``(j)``, which reached only 784 distinct
instructions in SmolLM2's first greedy set and repeated 565 of its 1,256 chat answers.

Jobs are numbered; job ``j`` depends only on ``(seed, j)``, and shard ``s`` holds jobs
``s * shard_jobs ...``. Generation goes through the batched engine (plain decoding,
sampled at ``temperature`` for diversity, each job its own seed), shards are written
atomically (:mod:`.shards`), and running again continues after the last whole shard
until the shards hold ``--tokens`` generated tokens.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..sources import bench_source_files
from . import shards
from .corpus import load_corpus
from .instructions import catalogue, instruction, self_instruct_seed
from .textdata import TrainInputError

#: Jobs out of every 10: chat, self-instruct, code (the default ``--mix``).
MIX = (("chat", 4), ("self-instruct", 2), ("code", 4))
KINDS = tuple(kind for kind, _ in MIX)
CODE_PROMPT_CHARS = (300, 1200)  # a code prompt's length, drawn in this range


@dataclass(frozen=True)
class DataSettings:
    """What every shard of one directory is made with (recorded; a rerun must match)."""

    target: str
    seed: int = 0
    shard_jobs: int = 64
    temperature: float = 0.8
    top_p: float = 1.0  # nucleus sampling sorts the vocabulary per row: 1.5x slower on this CPU
    max_new_tokens: int = 160
    question_tokens: int = 48
    mix: tuple[tuple[str, int], ...] = MIX
    instructions: str = "catalogue"


def parse_mix(text: str) -> tuple[tuple[str, int], ...]:
    """``"chat=6,self-instruct=3,code=1"`` -> ``MIX``-shaped pairs (kinds in ``KINDS`` order)."""
    counts: dict[str, int] = {}
    for part in text.split(","):
        kind, _, n = part.partition("=")
        kind = kind.strip()
        if kind not in KINDS or not n.strip().isdigit() or kind in counts:
            raise TrainInputError(f"--mix {text!r}: give each of {', '.join(KINDS)} at most once as KIND=N "
                                  "(jobs out of every sum), e.g. chat=6,self-instruct=3,code=1")
        counts[kind] = int(n)
    if not sum(counts.values()):
        raise TrainInputError(f"--mix {text!r} asks for no jobs; give at least one kind a count above 0")
    return tuple((kind, counts.get(kind, 0)) for kind in KINDS)


class JobPlan:
    """What each job of a directory writes: its kind and, for a chat job, its instruction."""

    def __init__(self, settings: DataSettings):
        self.mix, self.plan, self.greedy = settings.mix, settings.instructions, settings.temperature == 0
        self.period = sum(n for _, n in self.mix)

    def _slot(self, job: int) -> tuple[str, int]:
        """Job ``job``'s kind in the mix and its ordinal among the jobs of that kind."""
        slot, first = job % self.period, 0
        for kind, n in self.mix:
            if slot < first + n:
                return kind, (job // self.period) * n + slot - first
            first += n
        raise AssertionError

    def kind(self, job: int) -> str:
        """``chat``, ``self-instruct`` or ``code``."""
        kind, ordinal = self._slot(job)
        if kind == "chat" and self.plan == "catalogue" and self.greedy and ordinal >= len(catalogue()):
            return "self-instruct"  # every instruction asked once: a repeat would repeat its answer
        return kind

    def instruction(self, job: int) -> str:
        """The built-in instruction chat job ``job`` asks."""
        if self.plan == "cycle":
            return instruction(job)
        _, ordinal = self._slot(job)
        return catalogue()[ordinal % len(catalogue())]


def code_prompt(files: list[tuple[str, str]], rng: np.random.Generator) -> tuple[str, str]:
    """A cut of a random file: from a random line start, ``CODE_PROMPT_CHARS`` long, ending
    at a line end (``(prompt, "path:line")``)."""
    name, text = files[int(rng.integers(len(files)))]
    lines = text.splitlines(keepends=True)
    start = int(rng.integers(max(1, len(lines) - 20)))
    want = int(rng.integers(*CODE_PROMPT_CHARS))
    out, size = [], 0
    for line in lines[start:]:
        out.append(line)
        size += len(line)
        if size >= want:
            break
    return "".join(out), f"stdlib:{name}:{start + 1}"


def _code_files() -> list[tuple[str, str]]:
    """The corpus' train split, less the files the bench's prompts are cut from."""
    excluded = bench_source_files()
    files = [(n, t) for n, t in load_corpus().train if n not in excluded and len(t) > CODE_PROMPT_CHARS[1]]
    if not files:
        raise TrainInputError("no stdlib source files to cut code prompts from")
    return files


def check_settings(out: Path, settings: DataSettings, target_dir: Path, dtype: str = "float32") -> None:
    """Write ``selfdistill.json``, or check that the shards already there match it (``dtype``:
    the target's precision, which changes what it samples; older files made in float32)."""
    record = {"format": shards.FORMAT, **asdict(settings), "target_path": str(target_dir),
              "mix": dict(settings.mix), "dtype": dtype}
    path = out / shards.META_FILE
    if path.exists():
        old = {"dtype": "float32", "instructions": "cycle", **shards.read_meta(out)}  # older records: the first plan
        changed = [f"{k}: {old.get(k)} -> {v}" for k, v in record.items()
                   if k != "target_path" and old.get(k) != v]
        if changed:
            raise TrainInputError(
                f"{out} holds shards made with other settings ({'; '.join(changed[:3])}); use the same "
                "ones to add to it, or another --out")
        return
    if out.exists() and any(out.iterdir()):
        raise TrainInputError(f"--out {out} is not empty and holds no self-distillation shards; pass a "
                              "new directory")
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")


class ShardMaker:
    """Generates the documents of a shard with a loaded target (a plain-decoding
    :class:`~quickdraft.generator.SpeculativeGenerator`)."""

    def __init__(self, gen, settings: DataSettings, batch_size: int):
        self.gen, self.settings, self.batch_size = gen, settings, batch_size
        self.code_files = _code_files()

    def _request(self, prompt_ids: list[int], max_new: int, job: int, stage: int):
        from ..batch_generate import Request
        from ..decoding.sampling import SamplingParams

        s = self.settings
        seed = int(np.random.default_rng([s.seed, job, stage]).integers(2**31))
        temperature = max(s.temperature, 1.0) if stage == 0 else s.temperature  # questions: diverse
        return Request(prompt_ids, max_new, SamplingParams(temperature, 0, s.top_p, seed))

    def _run(self, requests):
        from ..batch_generate import generate_many

        return generate_many(self.gen, requests, batch_size=self.batch_size, num_speculative_tokens=0)

    def make(self, index: int) -> list[tuple[list[int], dict]]:
        s, gen = self.settings, self.gen
        jobs = range(index * s.shard_jobs, (index + 1) * s.shard_jobs)
        chat = lambda text: gen.chat_ids([{"role": "user", "content": text}])  # noqa: E731
        # Stage 0: the target writes the self-instruct jobs' instructions.
        plan = JobPlan(s)
        kinds = {j: plan.kind(j) for j in jobs}
        seeds = [j for j in jobs if kinds[j] == "self-instruct"]
        asks = [chat(self_instruct_seed(j)) for j in seeds]
        questions = self._run([self._request(p, s.question_tokens, j, 0) for p, j in zip(asks, seeds)])
        docs: list[tuple[list[int], dict]] = []
        written: dict[int, str] = {}
        for j, p, q in zip(seeds, asks, questions):
            docs.append(self._doc(p, q, j, "self-instruct-question", "seed request"))
            text = q.text.strip()
            if text:
                written[j] = text
        # Stage 1: answers and completions.
        prompts, meta = [], []
        for j in jobs:
            kind = kinds[j]
            if kind == "chat":
                prompts.append((chat(plan.instruction(j)), s.max_new_tokens))
                meta.append((j, kind, f"instruction {j}"))
            elif kind == "self-instruct" and j in written:
                prompts.append((chat(written[j]), s.max_new_tokens))
                meta.append((j, kind, "written by the target"))
            elif kind == "code":
                rng = np.random.default_rng([s.seed, j, 2])
                text, source = code_prompt(self.code_files, rng)
                ids = gen.tokenizer(text, add_special_tokens=False)["input_ids"]
                prompts.append((ids, s.max_new_tokens))
                meta.append((j, kind, source))
        outs = self._run([self._request(p, n, j, 1) for (p, n), (j, _, _) in zip(prompts, meta)])
        for (p, _), (j, kind, source), o in zip(prompts, meta, outs):
            docs.append(self._doc(p, o, j, kind, source))
        return docs

    @staticmethod
    def _doc(prompt_ids, out, job: int, kind: str, source: str) -> tuple[list[int], dict]:
        return (list(prompt_ids) + list(out.token_ids),
                {"job": job, "kind": kind, "source": source, "prompt_tokens": len(prompt_ids),
                 "new_tokens": len(out.token_ids), "text": out.text})


def _mix_for(text: str | None, recorded: dict | None) -> tuple[tuple[str, int], ...]:
    """``--mix``, else the directory's own, else ``MIX``."""
    if text is not None:
        return parse_mix(text)
    if recorded is not None and isinstance(recorded.get("mix"), dict):
        return tuple((kind, int(recorded["mix"].get(kind, 0))) for kind in KINDS)
    return MIX


def _plan_for(out: Path, recorded: dict | None) -> str:
    """A directory keeps the plan it was made with; a new one walks the catalogue."""
    if recorded is None:
        return "catalogue"
    if recorded.get("fresh_instructions"):  # made between sessions 38 and 39 (no such set was shipped)
        raise TrainInputError(f"{out} was made by an older quickdraft's greedy plan, which this version no "
                              "longer writes; pass a new --out")
    return recorded.get("instructions", "cycle")


def run_train_data(args, log=print) -> int:
    """Run ``quickdraft train data``; returns the exit code."""
    from tqdm import tqdm

    from ..generator import SpeculativeGenerator
    from ..models.loading import resolve_model_dir
    from ..models.placement import resolve_dtype
    from .distill import resolve_device

    out = Path(args.out)
    device = resolve_device(args.device)
    dtype = str(resolve_dtype(None, device)).removeprefix("torch.")  # the runtime's default there
    target_dir = resolve_model_dir(args.target)
    recorded = shards.read_meta(out) if (out / shards.META_FILE).exists() else None
    settings = DataSettings(target=str(args.target), seed=args.seed, shard_jobs=args.shard_jobs,
                            temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                            question_tokens=min(48, args.max_new_tokens),
                            mix=_mix_for(args.mix, recorded), instructions=_plan_for(out, recorded))
    check_settings(out, settings, target_dir, dtype)
    have = shards.totals(out)
    if have["generated"] >= args.tokens:
        log(f"[train data] {out} already holds {have['generated']:,} generated tokens "
            f"({have['shards']} shards); nothing to do (raise --tokens for more)")
        return 0
    gen = SpeculativeGenerator.from_pretrained(args.target, method="ar", device=str(device), dtype=dtype)
    vocab = len(gen.tokenizer)
    maker = ShardMaker(gen, settings, args.batch_size)
    done = set(shards.done_shards(out))
    index = 0
    generated, started, last = have["generated"], time.perf_counter(), 0.0
    log(f"[train data] {args.target}: {have['shards']} shards, {generated:,} generated tokens in {out}; "
        f"target {args.tokens:,}")
    bar = tqdm(total=args.tokens, initial=generated, unit="tok", desc="train data", disable=args.no_progress,
               dynamic_ncols=True, mininterval=2.0)
    new = 0
    stopped = False
    while generated < args.tokens:
        while index in done:
            index += 1
        elapsed = time.perf_counter() - started
        if args.max_seconds and elapsed + last > args.max_seconds:  # the next shard would overrun
            stopped = True
            break
        t0 = time.perf_counter()
        docs = maker.make(index)
        shards.write_shard(out, index, docs, vocab)
        last = time.perf_counter() - t0
        count = sum(rec["new_tokens"] for _, rec in docs)
        generated += count
        new += count
        bar.update(count)
        bar.set_postfix(shard=index, tok_s=f"{new / (time.perf_counter() - started):.0f}")
        done.add(index)
    bar.close()
    rate = new / max(time.perf_counter() - started, 1e-9)
    have = shards.totals(out)
    log(f"[train data] {out}: {have['shards']} shards, {have['documents']:,} documents, {have['tokens']:,} "
        f"tokens ({have['generated']:,} generated; this run {new:,} at {rate:.0f} tokens/s)"
        + ("; stopped at --max-seconds, run again to continue" if stopped else ""))
    return 0
