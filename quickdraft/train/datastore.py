"""``quickdraft train datastore``: the documents of self-distillation shard directories
(``quickdraft train data``) as one retrieval datastore for ``ngram``, ``hybrid`` and
``hybrid-eagle`` (:mod:`quickdraft.drafters.datastore`).

The bench's prompts are held out (:mod:`.holdout`), so a bench figure never measures a
copy of its own answer. The card lists what was left out.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from ..drafters.datastore import KIND, META_FILE, TOKENS_FILE, TOKENS_KEY, Datastore
from . import shards
from .holdout import HOLDOUT_NGRAM, HOLDOUT_SHARE, Holdout, bench_holdout
from .textdata import TrainInputError


def check_sources(sources: list[Path]) -> None:
    for root in sources:
        if not shards.is_shard_dir(root):
            raise TrainInputError(f"{root} is not a `quickdraft train data` directory (no {shards.META_FILE}); "
                                  f"pass the --out of `quickdraft train data`")


def build(sources: list[Path], tokenizer, holdout: Holdout | None, log=print) -> tuple[np.ndarray, dict]:
    """The documents of ``sources`` end to end (``-1`` between them) and what was kept."""
    parts: list[np.ndarray] = []
    report: dict = {"sources": [], "documents": 0, "tokens": 0, "held_out": []}
    for root in sources:  # (checked by check_sources before the target loaded)
        kept = 0
        for index in shards.done_shards(root):
            for rec, ids in shards.read_shard(root, index):
                prompt = tokenizer.decode(ids[: rec["prompt_tokens"]].tolist())
                why = holdout.reason(prompt, ids) if holdout is not None else None
                if why is not None:
                    report["held_out"].append({"document": f"{root.name}/{shards.shard_stem(index)}#{rec['job']}",
                                               "why": why, "prompt": prompt[-160:]})
                    continue
                parts += [ids.astype(np.int64), np.array([-1])]
                kept += 1
                report["tokens"] += int(ids.shape[0])
        report["documents"] += kept
        report["sources"].append({"path": str(root), "documents": kept, "target": shards.read_meta(root)["target"]})
        log(f"[train datastore] {root}: {kept:,} documents")
    if not parts:
        raise TrainInputError("no documents to store: the --data directories hold no complete shards")
    return np.concatenate(parts), report


def save(out: Path, tokens: np.ndarray, meta: dict, card: str) -> None:
    """``tokens`` (``-1`` between documents) as uint16/uint32 with the dtype's largest value
    between documents, the metadata and the card."""
    out.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if tokens.max() < np.iinfo(np.uint16).max else np.uint32
    stored = tokens.astype(dtype)
    stored[tokens < 0] = np.iinfo(dtype).max
    save_file({TOKENS_KEY: stored}, out / TOKENS_FILE)
    (out / META_FILE).write_text(json.dumps({"kind": KIND, **meta}, indent=1) + "\n")
    (out / "README.md").write_text(card)


def run_train_datastore(args, command: str, log=print) -> int:
    """Run ``quickdraft train datastore``; returns the exit code."""
    from ..generator import SpeculativeGenerator
    from ..models.exit_head import target_fingerprint
    from ..models.lm import NativeLM

    started = time.perf_counter()
    sources = [Path(p) for p in args.data]
    check_sources(sources)  # before the target loads: a typo fails in a second
    gen = SpeculativeGenerator.from_pretrained(args.target, method="ar")
    if not isinstance(gen.target, NativeLM):
        raise TrainInputError(f"{args.target} runs on transformers, not the native runtime; a datastore is "
                              f"matched to its target by the native runtime's fingerprint")
    holdout = None if args.no_holdout else bench_holdout(gen.tokenizer)
    tokens, report = build(sources, gen.tokenizer, holdout, log)
    fingerprint = target_fingerprint(gen.target.model)
    meta = {"target": str(args.target), "target_fingerprint": fingerprint, "max_ngram": args.max_ngram,
            "documents": report["documents"], "tokens": report["tokens"], "sources": report["sources"],
            "holdout": None if holdout is None else {
                "prompts": "every built-in bench prompt", "chat_word_share": HOLDOUT_SHARE,
                "shared_tokens": HOLDOUT_NGRAM, "held_out": report["held_out"]},
            "command": command}
    save(Path(args.out), tokens, meta, _card(meta, report))
    Datastore.load(args.out)  # it loads, or the error is ours now
    log(f"[train datastore] {args.out}: {report['documents']:,} documents, {report['tokens']:,} tokens "
        f"({len(report['held_out'])} held out) in {time.perf_counter() - started:.0f} s")
    return 0


def _card(meta: dict, report: dict) -> str:
    held = report["held_out"]
    reasons: dict[str, int] = {}
    for item in held:
        reasons[item["why"]] = reasons.get(item["why"], 0) + 1
    lines = [
        f"# Retrieval datastore for {meta['target']}",
        "",
        f"Text the target wrote itself (`quickdraft train data`), {report['documents']:,} documents and "
        f"{report['tokens']:,} tokens, searched by `--method ngram`, `hybrid` and `hybrid-eagle` when a "
        "sequence's own tail occurs nowhere earlier (`quickdraft/drafters/datastore.py`). Loaded by default "
        f"beside the target of fingerprint `{meta['target_fingerprint']}`; `--datastore none` turns it off.",
        "",
        "## Provenance",
        "",
        f"Built with `{meta['command']}` from:",
        "",
        *[f"- `{s['path']}`: {s['documents']:,} documents (target {s['target']})" for s in report["sources"]],
        "",
        "## Held out",
        "",
    ]
    if meta["holdout"] is None:
        lines.append("Nothing (`--no-holdout`): bench figures with this store may measure copies of their answers.")
    else:
        lines.append(f"{len(held)} documents whose prompt holds {HOLDOUT_SHARE:.0%} of a bench chat prompt's "
                     f"words or that share {HOLDOUT_NGRAM} tokens in a row with a bench prompt"
                     + (": " + ", ".join(f"{n} {why}" for why, n in sorted(reasons.items())) if held else "")
                     + ". Their list is in `datastore.json`.")
    return "\n".join(lines) + "\n"
