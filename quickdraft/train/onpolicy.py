"""Distillation text from the target's own continuations (on-policy data, as in DistillSpec).

A draft is only ever scored on what the target generates, and that differs from the
corpus: a small target repeats itself and prefers its own idioms. ``python -m
quickdraft.train.onpolicy --target T --data PATH... --out FILE.jsonl --prompts N`` cuts
``N`` prompts from the *training* split of ``--data`` (short and long contexts in turn,
each ending at a line start), lets the target continue each one (greedy unless
``--temperature``; decoded with its draft, which changes the speed, never the text) and
writes JSONL whose ``text`` is prompt + continuation: ``--data`` for ``quickdraft train
draft``.

Files the bench draws its prompts from are left out (``--keep-bench-files`` keeps them),
so a draft trained on this text is not trained on the bench's prompts.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path

from ..sources import bench_source_files
from .textdata import TrainInputError, read_text_data

SHORT = (64, 256)  # prompt tokens, drawn uniformly; prompts alternate short and long
LONG = (384, 1536)
MIN_DOC_CHARS = 400


def cut_prompts(docs: Sequence[tuple[str, str]], tok, n: int, seed: int, max_tokens: int,
                short: tuple[int, int] = SHORT, long: tuple[int, int] = LONG) -> list[dict]:
    """``n`` prompts ``{"name", "prompt"}``, each the lines before a random line start of a
    random document, about ``short`` or ``long`` tokens long (in turn) and never more than
    ``max_tokens`` (whole lines are dropped from the front until it fits)."""
    rng = random.Random(seed)
    docs = [d for d in docs if len(d[1]) >= MIN_DOC_CHARS]
    if not docs:
        raise TrainInputError(f"no training document has {MIN_DOC_CHARS} characters or more; "
                              "pass more text with --data")
    out = []
    for _ in range(50 * n):
        if len(out) == n:
            break
        name, text = rng.choice(docs)
        lo, hi = short if len(out) % 2 == 0 else long
        want = min(rng.randint(lo, hi), max_tokens)
        sample = text[:4000]  # under the tokenizer's model_max_length: no warning
        chars_per_token = len(sample) / max(1, len(tok(sample)["input_ids"]))
        starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n" and i + 1 < len(text)]
        ends = [c for c in starts if c >= min(want * chars_per_token, len(text) * 0.8)]
        if not ends:
            continue
        end = rng.choice(ends)
        begin = max(0, end - int(want * chars_per_token))
        begin = next((s for s in starts if s >= begin), 0)  # whole lines only
        prompt = text[begin:end]
        while len(tok(prompt)["input_ids"]) > max_tokens and "\n" in prompt[:-1]:
            prompt = prompt[prompt.index("\n") + 1:]
        if prompt.strip() and len(tok(prompt)["input_ids"]) <= max_tokens:
            out.append({"name": name, "prompt": prompt})
    if len(out) < n:
        raise TrainInputError(f"could cut only {len(out)} of {n} prompts of at most {max_tokens} tokens "
                              "at line starts; pass more text with --data or ask for fewer --prompts")
    return out


def generate_continuations(gen, prompts: list[dict], max_new_tokens: int, temperature: float,
                           seed: int, batch_size: int, progress: bool = True) -> list[dict]:
    """Continue every prompt with ``gen`` (a ``SpeculativeGenerator``), in batches."""
    from tqdm import tqdm

    out = []
    chunk = batch_size * 4
    with tqdm(total=len(prompts), unit="prompt", disable=not progress, desc="continuations") as bar:
        for i in range(0, len(prompts), chunk):
            part = prompts[i:i + chunk]
            results = gen.generate([p["prompt"] for p in part], max_new_tokens=max_new_tokens,
                                   temperature=temperature, seed=seed + i, batch_size=batch_size)
            for p, r in zip(part, results):
                out.append({"text": p["prompt"] + r.text, "source": p["name"],
                            "prompt_chars": len(p["prompt"]), "prompt_tokens": r.stats.prompt_tokens,
                            "new_tokens": len(r.token_ids)})
            bar.update(len(part))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quickdraft.train.onpolicy",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=None, help="target model (default: the embedded one)")
    parser.add_argument("--draft", default=None,
                        help="draft used to decode faster (default: the target's paired draft; "
                             "the text is the target's either way)")
    parser.add_argument("--data", nargs="+", required=True, metavar="PATH",
                        help="where prompts are cut from (as for `train draft`; its training split only)")
    parser.add_argument("--out", required=True, type=Path, help="JSONL file to write")
    parser.add_argument("--prompts", type=int, default=512, help="how many continuations (default 512)")
    parser.add_argument("--max-new-tokens", type=int, default=160, help="per continuation (default 160)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts decoded at once (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="which prompts are cut, and sampling")
    parser.add_argument("--keep-bench-files", action="store_true",
                        help="also cut prompts from the files the bench's prompts come from")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.max_new_tokens < 1 or args.batch_size < 1 or args.temperature < 0:
        parser.error("--prompts, --max-new-tokens and --batch-size must be >= 1, --temperature >= 0")
    from ..generator import SpeculativeGenerator
    from ..models.loading import CheckpointError

    try:
        data = read_text_data(args.data)
        docs = data.train
        if not args.keep_bench_files:
            bench = bench_source_files()
            docs = [d for d in docs if d[0] not in bench]
        try:
            gen = SpeculativeGenerator.from_pretrained(args.target, args.draft, method="draft")
        except (CheckpointError, ValueError):
            if args.draft is not None:
                raise
            # no paired draft yet (the usual case before the first `train draft`): plain decoding
            gen = SpeculativeGenerator.from_pretrained(args.target, method="ar")
        room = gen.target.context_length - args.max_new_tokens - 1
        if room < 1:
            raise TrainInputError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the "
                                  f"target's {gen.target.context_length}-token context; lower it")
        prompts = cut_prompts(docs, gen.tokenizer, args.prompts, args.seed, room)
    except (TrainInputError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = generate_continuations(gen, prompts, args.max_new_tokens, args.temperature, args.seed,
                                  args.batch_size, progress=not args.no_progress)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    new = sum(r["new_tokens"] for r in rows)
    print(f"{len(rows)} continuations, {new:,} generated tokens "
          f"(prompts {sum(r['prompt_tokens'] for r in rows):,} tokens) -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
