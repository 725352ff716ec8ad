"""Write ``draft_vocab.json`` for a head trained before its trainer wrote one.

``quickdraft train exit-head`` and ``train heads --kind eagle`` now rank the tokens of
their training text themselves (``models/draft_vocab.py``); heads trained earlier, such as
the shipped ones, get the same file from this script, counted on the same text the same
way (the train split, tokenized as the trainer does). An exit head's file ranks the whole
vocabulary; an EAGLE drafter's only the tokens its reduced head stores.

    python scripts/rank_head_vocab.py HEAD_DIR --target NAME --data SRC [SRC ...] [--size N]

``--size``: the number ``--draft-vocab`` defaults to (an exit head: an eighth of the
vocabulary, at least 1024; an EAGLE drafter: all of its rows).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quickdraft.models.draft_vocab import default_vocab_size, write_draft_vocab  # noqa: E402
from quickdraft.models.eagle import is_eagle_dir  # noqa: E402
from quickdraft.models.exit_head import is_exit_head_dir  # noqa: E402
from quickdraft.train.distill import tokenize  # noqa: E402
from quickdraft.train.exit_head import load_native_teacher  # noqa: E402
from quickdraft.train.textdata import read_text_data  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("head", type=Path, help="an exit head or EAGLE drafter directory")
    ap.add_argument("--target", required=True, help="the target it was trained on")
    ap.add_argument("--data", nargs="+", required=True, help="its training text (train's --data)")
    ap.add_argument("--size", type=int, default=None, help="the default --draft-vocab")
    ap.add_argument("--seq-len", type=int, default=512, help="train's --seq-len (default 512)")
    args = ap.parse_args()
    target, _, tok = load_native_teacher(args.target)
    vocab_size = target.config.vocab_size
    counts = np.bincount(tokenize(read_text_data(args.data), tok, args.seq_len).train, minlength=vocab_size)
    if is_eagle_dir(args.head):
        with safe_open(str(args.head / "model.safetensors"), "pt") as f:
            ids = f.get_tensor("vocab_ids").numpy()
        size = len(ids) if args.size is None else args.size
    elif is_exit_head_dir(args.head):
        ids, size = None, default_vocab_size(vocab_size) if args.size is None else args.size
    else:
        ap.error(f"{args.head} is neither an exit head nor an EAGLE drafter")
    record = write_draft_vocab(args.head, counts, size, ids)
    print(f"{args.head}: {len(record['ranking']):,} tokens ranked on {record['counted_tokens']:,}, default "
          f"{record['size']:,} ({record['size_covers']:.1%} of the text)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
