"""Self-distillation data on disk: a directory of small shards a target generated.

::

    DIR/selfdistill.json        the target and the settings every shard was made with
    DIR/shard-00000.npy         uint16 (uint32 above 65536 tokens) ids of its documents, end to end
    DIR/shard-00000.jsonl       one line per document: kind, source, prompt and generated
                                token counts, the generated text

A document is a prompt and what the target wrote after it. Each file is written to a
temporary name and renamed, the ``.jsonl`` last, so a shard exists once its ``.jsonl``
does: an interrupted run leaves no half shard, and running again continues after the
last whole one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

META_FILE = "selfdistill.json"
FORMAT = 1


def is_shard_dir(path: Path) -> bool:
    return Path(path).is_dir() and (Path(path) / META_FILE).is_file()


def shard_stem(index: int) -> str:
    return f"shard-{index:05d}"


def done_shards(root: Path) -> list[int]:
    """Indices of the complete shards (their ``.jsonl`` written), sorted."""
    out = []
    for p in Path(root).glob("shard-*.jsonl"):
        try:
            out.append(int(p.stem.split("-")[1]))
        except (IndexError, ValueError):
            continue
    return sorted(out)


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def write_shard(root: Path, index: int, docs: list[tuple[list[int], dict]], vocab_size: int) -> None:
    """Write shard ``index``: ``docs`` are ``(token ids, record)``; the record gets the
    document's offset and length in the ids file."""
    dtype = np.uint16 if vocab_size <= 65536 else np.uint32
    parts, lines, offset = [], [], 0
    for ids, record in docs:
        parts.append(np.asarray(ids, dtype=dtype))
        lines.append(json.dumps({**record, "offset": offset, "length": len(ids)}, ensure_ascii=False))
        offset += len(ids)
    stem = Path(root) / shard_stem(index)
    ids = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    _atomic_write(stem.with_suffix(".npy"), lambda f: np.save(f, ids))
    _atomic_write(stem.with_suffix(".jsonl"), lambda f: f.write(("\n".join(lines) + "\n").encode()))


def read_meta(root: Path) -> dict:
    return json.loads((Path(root) / META_FILE).read_text())


def read_shard(root: Path, index: int) -> list[tuple[dict, np.ndarray]]:
    """The documents of one shard as ``(record, ids)``."""
    stem = Path(root) / shard_stem(index)
    ids = np.load(stem.with_suffix(".npy"))
    docs = []
    for line in stem.with_suffix(".jsonl").read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            docs.append((rec, ids[rec["offset"] : rec["offset"] + rec["length"]]))
    return docs


def read_documents(root: Path) -> list[tuple[str, np.ndarray, int]]:
    """Every document of the complete shards as ``(name, ids, prompt tokens)``, named
    ``shard-NNNNN#i``."""
    root = Path(root)
    meta = read_meta(root)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{root}/{META_FILE} has format {meta.get('format')}, this quickdraft reads "
                         f"format {FORMAT}; regenerate it with `quickdraft train data`")
    out = []
    for index in done_shards(root):
        for i, (rec, ids) in enumerate(read_shard(root, index)):
            out.append((f"{shard_stem(index)}#{i}", ids, int(rec["prompt_tokens"])))
    return out


def totals(root: Path) -> dict:
    """Documents, stored tokens and generated tokens in the complete shards, by kind."""
    out: dict = {"shards": 0, "documents": 0, "tokens": 0, "generated": 0, "kinds": {}}
    for index in done_shards(root):
        out["shards"] += 1
        for rec, ids in read_shard(root, index):
            out["documents"] += 1
            out["tokens"] += int(ids.size)
            out["generated"] += rec["new_tokens"]
            kind = out["kinds"].setdefault(rec["kind"], {"documents": 0, "generated": 0})
            kind["documents"] += 1
            kind["generated"] += rec["new_tokens"]
    return out
