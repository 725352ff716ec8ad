"""Retrieval drafting from a datastore of the target's own text (drafters/datastore.py) and
`quickdraft train datastore` (train/datastore.py)."""

from __future__ import annotations

import copy
import json
from collections import Counter

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from quickdraft import cli
from quickdraft.drafters import datastore as ds
from quickdraft.drafters.datastore import Datastore, Retrieval
from quickdraft.drafters.factory import DraftOptions, make_drafter, ngram_drafter
from quickdraft.drafters.ngram import NgramDrafter
from quickdraft.generator import SpeculativeGenerator
from quickdraft.train import shards
from quickdraft.train.holdout import BENCH_PROMPTS_DIR, HOLDOUT_NGRAM, bench_holdout

TARGET = "qd-stdlib-target"


def brute_force(corpus: list[int], context: list[int], k: int, max_ngram: int) -> Retrieval | None:
    """The longest tail (2..max_ngram tokens) of ``context`` inside one document of
    ``corpus`` (-1 between documents), and the majority continuation token by token."""
    for n in range(min(max_ngram, len(context)), 1, -1):
        tail = context[-n:]
        follow = [p + n for p in range(len(corpus) - n + 1) if corpus[p : p + n] == tail]
        if not follow:
            continue
        out, support, first_share = [], len(follow), 0.0
        padded = corpus + [-1] * (k + 1)
        for depth in range(k):
            counts = Counter(padded[f + depth] for f in follow)
            best, count = min(counts.items(), key=lambda item: (-item[1], item[0]))  # ties: the smallest id
            share = count / len(follow)
            if best < 0 or (depth > 0 and share < ds.MIN_NEXT_SHARE):
                break
            out.append(best)
            if depth == 0:
                first_share = share
            follow = [f for f in follow if padded[f + depth] == best]
        return Retrieval(out, n, support, first_share) if out else None
    return None


def always(store: Datastore) -> Datastore:
    """``store`` proposing whatever it finds (no confidence gate), sharing its index."""
    open_store = copy.copy(store)
    open_store.min_first_share, open_store.min_ngram, open_store.min_support = 0.0, 2, 1
    return open_store


@pytest.mark.parametrize("seed", range(6))
def test_lookup_is_the_longest_tail_and_its_majority_continuation(seed):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 4 + seed, size=rng.integers(5, 60)).tolist() for _ in range(12)]
    corpus = [t for doc in docs for t in [*doc, -1]]
    store = always(Datastore(np.array(corpus), max_ngram=5))
    for _ in range(60):
        context = rng.integers(0, 4 + seed, size=rng.integers(1, 9)).tolist()
        k = int(rng.integers(1, 7))
        want = brute_force(corpus, context, k, 5)
        got = store.lookup(np.array(context), k)
        assert got == want, (context, k)


def test_the_gate_wants_a_long_or_well_supported_match_that_most_matches_continue():
    # "1 2" occurs 5 times (4 times followed by 3); "7 8 9" once, then 4.
    store = Datastore(np.array([1, 2, 3, -1, 1, 2, 3, -1, 1, 2, 3, -1, 1, 2, 3, -1, 1, 2, 5, -1, 7, 8, 9, 4, -1,
                                6, 8, 3, -1]))
    found = store.lookup(np.array([0, 1, 2]), 2)
    assert (found.tokens, found.ngram, found.support, found.first_share) == ([3], 2, 5, 0.8)
    assert store.confident(found)  # 5 matches, 80% agree
    assert store.confident(store.lookup(np.array([7, 8, 9]), 3))  # three tokens matched, once
    once = store.lookup(np.array([5, 6, 8]), 3)  # "6 8" once: too short and too rare
    assert once is not None and (once.tokens, once.ngram) == ([3], 2) and not store.confident(once)
    assert store.lookup(np.array([4, 8, 3]), 3) is None  # "8 3" ends its document: nothing follows
    assert store.lookup(np.array([9, 9]), 3) is None  # never seen
    assert NgramDrafter(3, 2, store).lookup(torch.tensor([5, 6, 8]), 3).size == 0
    assert NgramDrafter(3, 2, store).lookup(torch.tensor([0, 7, 8, 9]), 3).tokens.tolist() == [4]
    # the sequence's own earlier tokens come first
    assert NgramDrafter(3, 2, store).lookup(torch.tensor([7, 8, 9, 6, 7, 8, 9]), 2).tokens.tolist() == [6, 7]


def test_a_common_bigram_is_subsampled_and_still_proposes_real_continuations():
    rng = np.random.default_rng(0)
    corpus = np.concatenate([np.array([1, 2, int(t), -1]) for t in rng.integers(3, 6, size=3 * ds.MAX_MATCHES)])
    found = always(Datastore(corpus)).lookup(np.array([1, 2]), 3)
    assert found.support <= ds.MAX_MATCHES and found.tokens[0] in (3, 4, 5) and len(found.tokens) == 1


def _write_shards(root, docs, tokenizer):
    root.mkdir(parents=True)
    (root / shards.META_FILE).write_text(json.dumps({"format": shards.FORMAT, "target": TARGET}))
    records = []
    for job, (prompt, answer) in enumerate(docs):
        p, a = tokenizer.encode(prompt, add_special_tokens=False), tokenizer.encode(answer, add_special_tokens=False)
        records.append((p + a, {"job": job, "kind": "chat", "prompt_tokens": len(p), "new_tokens": len(a)}))
    shards.write_shard(root, 0, records, len(tokenizer))


def test_train_datastore_holds_the_bench_prompts_out_and_loads(tmp_path, capsys):
    gen = SpeculativeGenerator.from_pretrained(TARGET, method="ar")
    holdout = bench_holdout(gen.tokenizer)
    code_prompt = json.loads((BENCH_PROMPTS_DIR / "short.jsonl").read_text().splitlines()[0])["prompt"]
    docs = [("Please write a Python function that checks whether a string is a palindrome.", "def f(s): ..."),
            ("Explain recursion in simple terms.", "Recursion is when a function calls itself."),
            ("Continue this code:\n" + code_prompt[:200], "pass"),
            ("What is a hash table?", "A table of hashes.")]
    assert holdout.reason(docs[0][0], np.array([0])) == "asks a bench chat prompt"
    _write_shards(tmp_path / "data", docs, gen.tokenizer)
    out = tmp_path / "store"
    assert cli.main(["train", "datastore", "--target", TARGET, "--data", str(tmp_path / "data"),
                     "--out", str(out)]) == 0
    meta = json.loads((out / ds.META_FILE).read_text())
    why = [item["why"] for item in meta["holdout"]["held_out"]]
    assert why == ["asks a bench chat prompt", f"shares {HOLDOUT_NGRAM} tokens with a bench prompt"]
    assert meta["documents"] == 2 and "2 documents" in (out / "README.md").read_text().replace(",", "")
    def encode(text):
        return gen.tokenizer.encode(text, add_special_tokens=False)

    kept = [encode(docs[i][0]) + encode(docs[i][1]) for i in (1, 3)]  # as _write_shards stored them
    stored = load_file(out / ds.TOKENS_FILE)[ds.TOKENS_KEY]
    assert stored.dtype == np.uint16 and (stored == np.iinfo(np.uint16).max).sum() == 2
    store = Datastore.load(out)
    assert store.size == len(kept[0]) + len(kept[1])
    assert store.tokens[: store.size + 2].tolist() == [*kept[0], -1, *kept[1], -1]
    assert meta["target_fingerprint"] and meta["kind"] == ds.KIND
    # --no-holdout keeps them all
    assert cli.main(["train", "datastore", "--target", TARGET, "--data", str(tmp_path / "data"),
                     "--out", str(tmp_path / "all"), "--no-holdout"]) == 0
    assert json.loads((tmp_path / "all" / ds.META_FILE).read_text())["documents"] == 4


def test_bad_input_is_one_line(tmp_path, capsys):
    assert cli.main(["train", "datastore", "--target", TARGET, "--data", str(tmp_path), "--out",
                     str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not a `quickdraft train data` directory" in err
    assert cli.main(["train", "datastore", "--target", TARGET, "--data", str(tmp_path), "--out",
                     str(tmp_path / "o"), "--max-ngram", "1"]) == 2
    assert "--max-ngram must be at least 2" in capsys.readouterr().err
    for datastore, message in ((str(tmp_path / "missing"), "no such directory"),
                               (str(tmp_path), "is not a datastore directory")):
        assert cli.main(["generate", "--model", TARGET, "--method", "ngram", "--datastore", datastore,
                         "--max-new-tokens", "4", "--prompt", "x"]) != 0
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and message in err, err
    assert cli.main(["generate", "--model", TARGET, "--method", "ar", "--datastore", "none", "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--method ar has none" in err, err
    (tmp_path / ds.META_FILE).write_text('{"kind": "something else"}')
    save_file({ds.TOKENS_KEY: np.zeros(3, dtype=np.uint16)}, tmp_path / ds.TOKENS_FILE)
    with pytest.raises(ValueError, match="is not a quickdraft datastore"):
        Datastore.load(tmp_path)
    (tmp_path / ds.META_FILE).write_text(json.dumps({"kind": ds.KIND}))
    save_file({ds.TOKENS_KEY: np.zeros(3, dtype=np.float32)}, tmp_path / ds.TOKENS_FILE)
    with pytest.raises(ValueError, match="must be one row of uint16 or uint32"):
        Datastore._read(tmp_path)
    (tmp_path / ds.TOKENS_FILE).write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="not a datastore's token file"):
        Datastore._read(tmp_path)


@pytest.fixture(scope="module")
def own_text():
    """The embedded target, and a datastore of what it wrote after some prompts."""
    gen = SpeculativeGenerator.from_pretrained(TARGET, method="ar")
    prompts = ["def parse_args(argv):", "class Stack:\n    def __init__(self):", "import os\n\ndef walk(path):"]
    docs = []
    for prompt in prompts:
        ids = gen.encode(prompt).tolist()
        docs += [*ids, *gen.generate(ids, max_new_tokens=48).token_ids, -1]
    return gen, prompts, Datastore(np.array(docs))


def test_greedy_decoding_with_a_datastore_is_plain_decoding_and_it_proposes(own_text):
    gen, prompts, store = own_text
    counted = Counter()

    class Counting(Datastore):
        def lookup(self, context, k):
            found = super().lookup(context, k)
            counted["confident"] += self.confident(found)
            return found

    counting = copy.copy(store)
    counting.__class__ = Counting
    draft = SpeculativeGenerator.from_pretrained(TARGET, method="hybrid").draft  # the embedded draft
    for method in ("ngram", "hybrid"):
        spec = SpeculativeGenerator.for_pair(gen.target, draft if method == "hybrid" else None, gen.tokenizer,
                                             method, DraftOptions(datastore=counting))
        for prompt in [*prompts, "def parse_args(argv, defaults):"]:
            ids = gen.encode(prompt).tolist()
            want = gen.generate(ids, max_new_tokens=40).token_ids
            out = spec.generate(ids, max_new_tokens=40, num_speculative_tokens=4)
            assert out.token_ids == want
        batched = spec.generate(prompts, max_new_tokens=40, num_speculative_tokens=4, batch_size=3)
        assert [o.token_ids for o in batched] == [gen.generate(p, max_new_tokens=40).token_ids for p in prompts]
    assert counted["confident"] > 10  # the store proposed, so the equality above tested it


def test_sampling_with_a_datastore_keeps_the_targets_distribution():
    from test_sampling_exact import TARGET as TINY
    from test_sampling_exact import empirical_pvalue

    from quickdraft.decoding.sampling import SamplingParams

    rng = np.random.default_rng(0)
    store = always(Datastore(rng.integers(0, 5, size=400)))
    proposals = Counter()

    class Counting(NgramDrafter):
        def lookup(self, sequence, k):
            found = super().lookup(sequence, k)
            proposals[found.size > 0] += 1
            return found

    assert empirical_pvalue(TINY, Counting(3, 2, store), SamplingParams(temperature=1.0), k=3) > 1e-3
    assert proposals[True] > proposals[False]


def test_method_defaults_and_the_shipped_datastore(own_text, tmp_path, monkeypatch):
    gen, _, store = own_text
    assert ngram_drafter("hybrid-eagle", DraftOptions(), None).ngram_min == 3
    assert ngram_drafter("hybrid-eagle", DraftOptions(ngram_max=2), None).ngram_min == 2
    assert ngram_drafter("ngram", DraftOptions(), None).ngram_min == 2
    assert ngram_drafter("hybrid", DraftOptions(ngram_min=3), None).ngram_min == 3
    # a datastore shipped for the embedded target: ngram and hybrid search it unless told not to
    from quickdraft.models.exit_head import target_fingerprint
    from quickdraft.train.datastore import save

    shipped = tmp_path / "datastores"
    save(shipped / "embedded", np.concatenate([store.tokens[store.tokens >= 0][:50], [-1]]),
         {"target": TARGET, "target_fingerprint": target_fingerprint(gen.target.model), "max_ngram": 8}, "card")
    monkeypatch.setattr(ds, "DATASTORES_DIR", shipped)
    assert ds.shipped_datastore(gen.target) == shipped / "embedded"
    vocab = gen.target.vocab_size
    assert make_drafter("ngram", None, vocab, DraftOptions(), target=gen.target).datastore.size == 50
    assert make_drafter("ngram", None, vocab, DraftOptions(datastore="none"), target=gen.target).datastore is None
    assert make_drafter("hybrid", gen.target, vocab, DraftOptions(), target=gen.target).ngram.datastore is not None
    monkeypatch.setattr(ds, "DATASTORES_DIR", tmp_path / "nothing")
    assert make_drafter("ngram", None, vocab, DraftOptions(), target=gen.target).datastore is None


def test_training_leaves_out_shard_documents_that_ask_a_bench_prompt(tmp_path):
    from quickdraft.train.distill import tokenize
    from quickdraft.train.textdata import read_text_data

    tok = SpeculativeGenerator.from_pretrained(TARGET, method="ar").tokenizer
    docs = [("Write a Python function that returns the n-th Fibonacci number.", "def fib(n): ..."),
            *[(f"Explain topic number {i} in simple terms.", f"Topic {i} is simple.") for i in range(30)]]
    _write_shards(tmp_path / "data", docs, tok)
    data = read_text_data([str(tmp_path / "data")])
    assert len(data.train_ids) + len(data.heldout_ids) == 31
    tokens = tokenize(data, tok, 8)
    assert tokens.manifest["held_out"] == [{"document": "data/shard-00000#0", "why": "asks a bench chat prompt"}]
    assert len(data.train_ids) + len(data.heldout_ids) == 30
    fib = tok.encode(docs[0][0] + docs[0][1], add_special_tokens=False)
    stream = np.concatenate([tokens.train, tokens.heldout])
    assert not any(np.array_equal(stream[i : i + len(fib)], fib) for i in range(stream.size))
    assert tokens.manifest["split"]["train_documents"] + tokens.manifest["split"]["heldout_documents"] == 30
