"""Token trees, multi-draft and n-gram drafting on the one engine: greedy output equals
plain decoding for every method and shape; the KV cache after a tree step equals a fresh
prefill of the accepted sequence; bad settings are one-line errors."""

import random

import pytest
import torch

from quickdraft.cli import main
from quickdraft.decoding.engine import decode
from quickdraft.decoding.proposal import Proposal, tree_attention
from quickdraft.decoding.sampling import SamplingParams
from quickdraft.decoding.stats import GenerationStats
from quickdraft.decoding.stopping import StopConditions
from quickdraft.drafters import DraftOptions, NgramDrafter, make_drafter
from quickdraft.models.lm import load_model

PROMPTS = ["def add(a, b):", "class Point:\n    def", "x", "for i in range(10):\n    print(i"]
# (method, options): every shape family, including the degenerate ones.
SETTINGS = [
    ("tree", DraftOptions(tree="1")),
    ("tree", DraftOptions(tree="2,2,1")),
    ("tree", DraftOptions(tree="3,1,2,1")),
    ("tree", DraftOptions(tree="2,2,1", tree_children="top")),
    ("tree", DraftOptions(tree="dynamic:1")),
    ("tree", DraftOptions(tree="dynamic:7")),
    ("multi-draft", DraftOptions(num_drafts=1)),
    ("multi-draft", DraftOptions(num_drafts=3)),
    ("ngram", DraftOptions(ngram_max=3, ngram_min=1)),
    ("ngram", DraftOptions(ngram_max=4, ngram_min=2)),
    ("hybrid", DraftOptions()),
]


def run(target, ids, n, drafter=None, k=4, eos=(), stats=None, params=SamplingParams()):
    steps = decode(target, ids, StopConditions(n, eos), drafter=drafter, num_speculative_tokens=k,
                   stats=stats, params=params)
    return [t for s in steps for t in s.tokens]


@pytest.mark.parametrize("method,options", SETTINGS, ids=[f"{m}-{o.tree}-{o.num_drafts}-{o.ngram_max}{o.tree_children}"
                                                          for m, o in SETTINGS])
def test_greedy_tree_methods_equal_plain(models, method, options):
    tok, target, drafts = models
    for prompt in PROMPTS:
        ids = torch.tensor(tok(prompt)["input_ids"])
        reference = run(target, ids, 30)
        for draft_name, k in (("perturbed", 4), ("unrelated", 3), ("copy", 6)):
            drafter = make_drafter(method, drafts[draft_name], target.vocab_size, options)
            assert run(target, ids, 30, drafter, k) == reference, (prompt, draft_name, k)


def test_trees_accept_more_than_one_token_per_pass(models):
    """Not only lossless but speculative: a copy of the target is always right."""
    tok, target, drafts = models
    ids = torch.tensor(tok(PROMPTS[0])["input_ids"])
    for options in (DraftOptions(tree="2,2,1"), DraftOptions(tree="dynamic:6")):
        stats = GenerationStats()
        run(target, ids, 30, make_drafter("tree", drafts["copy"], target.vocab_size, options), 4, stats=stats)
        assert stats.mean_accepted_tokens > 2.5


def test_greedy_multi_draft_accepts_at_least_what_the_chain_does(models):
    """Greedy multi-draft carries the draft's argmax chain, so its walk is never shorter
    than the chain drafter's; sampled siblings can only add to it."""
    tok, target, drafts = models
    for draft_name in ("perturbed", "copy"):
        taus = {}
        for method, options in (("draft", DraftOptions()), ("multi-draft", DraftOptions(num_drafts=3))):
            stats = GenerationStats()
            for prompt in PROMPTS:
                ids = torch.tensor(tok(prompt)["input_ids"])
                one = GenerationStats()
                run(target, ids, 30, make_drafter(method, drafts[draft_name], target.vocab_size, options), 4,
                    stats=one)
                stats.merge(one)
            taus[method] = stats.mean_accepted_tokens
        assert taus["multi-draft"] >= taus["draft"] - 1e-9, (draft_name, taus)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_max_tokens_and_eos_inside_an_accepted_tree_path(models, n):
    tok, target, drafts = models
    ids = torch.tensor(tok(PROMPTS[1])["input_ids"])
    reference = run(target, ids, 30)
    eos = reference[6]
    expected = reference[: reference.index(eos)]
    for method, options in SETTINGS[1:8:3]:
        drafter = make_drafter(method, drafts["copy"], target.vocab_size, options)
        assert run(target, ids, n, drafter, 4) == reference[:n]
        stats = GenerationStats()
        assert run(target, ids, 30, drafter, 4, eos=[eos], stats=stats) == expected
        assert stats.finish_reason == "stop"


def test_ngram_proposes_the_continuation_of_the_latest_match():
    drafter = NgramDrafter(ngram_max=3, ngram_min=1)
    seq = torch.tensor([5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6, 7])
    proposal = drafter.lookup(seq, 3)
    assert proposal.is_chain and proposal.probs is None
    assert proposal.tokens.tolist() == [2, 3, 5]  # the latest earlier "5 6 7" with 3 tokens after it
    assert drafter.lookup(torch.tensor([1, 2, 3, 4]), 3).size == 0  # nothing matches: a plain step
    assert drafter.lookup(torch.tensor([4, 9, 4]), 3).tokens.tolist() == [9, 4]  # short continuation


def test_ngram_lookup_follows_its_rule_on_random_sequences():
    """The rule, spelled out: the longest tail (ngram_max down to ngram_min) with an earlier
    occurrence; of those occurrences the latest with k tokens after it, else the earliest.
    Ids of several bytes alike (the lookup searches the ids' bytes: a match straddling two
    ids is none)."""
    def rule(seq: list[int], k: int, most: int, least: int) -> list[int]:
        length = len(seq)
        for n in range(min(most, length - 1), least - 1, -1):
            starts = [s for s in range(length - n) if seq[s : s + n] == seq[length - n :]]
            full = [s for s in starts if s + n + k <= length]
            if starts:
                begin = (full[-1] if full else starts[0]) + n
                return seq[begin : begin + k]
        return []

    rng = random.Random(0)
    for _ in range(3000):
        pool = rng.choice([[0, 1], [0, 1, 2, 3, 4], [1, 256, 257, 65536, 2**40, 2**40 + 1]])
        seq = [rng.choice(pool) for _ in range(rng.randint(1, 30))]
        most = rng.randint(1, 4)
        least, k = rng.randint(1, most), rng.randint(1, 8)
        proposal = NgramDrafter(most, least).lookup(torch.tensor(seq), k)
        assert (proposal.tokens.tolist() if proposal.size else []) == rule(seq, k, most, least), (seq, k, most, least)


def test_ngram_never_costs_a_wide_pass_without_a_match(models):
    tok, target, _ = models
    stats = GenerationStats()
    ids = torch.arange(3, 40)  # no token repeats: lookup finds nothing until the output repeats
    out = run(target, ids, 20, NgramDrafter(3, 2), 4, stats=stats)
    assert out == run(target, ids, 20)
    assert stats.drafted_tokens <= 4 * stats.target_forward_passes


def tree_step(lm, prefix, proposal):
    """Feed ``prefix`` then the tree, as the engine does (the last prefix token uncached)."""
    lm.reset(64)
    lm.extend(prefix[:-1], logits="none")
    positions, mask = tree_attention(proposal, lm.length, prefix.numel())
    return lm.extend(torch.cat([prefix[-1:], proposal.tokens]), positions=positions, mask=mask)


def test_kv_compaction_equals_fresh_prefill(tiny_family):
    lm, fresh = load_model(tiny_family["target"]), load_model(tiny_family["target"])
    prefix = torch.tensor([3, 17, 42, 8, 99, 23])
    #        0   1   2   3   4   5   6
    tokens = torch.tensor([11, 12, 13, 14, 15, 16, 17])
    parents = torch.tensor([-1, -1, 0, 1, 1, 3, 4])
    proposal = Proposal(tokens, parents)
    logits = tree_step(lm, prefix, proposal)
    path = [1, 4, 6]
    # The tree pass scores each node as if its path were the sequence.
    fresh.reset(64)
    want = fresh.extend(torch.cat([prefix, tokens[path]]))
    torch.testing.assert_close(logits[[0, 2, 5, 7]], want[[5, 6, 7, 8]], atol=1e-5, rtol=1e-5)
    lm.compact(prefix.numel(), path)
    assert lm.length == prefix.numel() + len(path)
    n = lm.length
    torch.testing.assert_close(lm.cache.k[:, :, :, :n], fresh.cache.k[:, :, :, :n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lm.cache.v[:, :, :, :n], fresh.cache.v[:, :, :, :n], atol=1e-5, rtol=1e-5)
    # ... and the next step's logits equal those of the fresh prefill's next step.
    torch.testing.assert_close(lm.extend(torch.tensor([77, 5])), fresh.extend(torch.tensor([77, 5])),
                               atol=1e-5, rtol=1e-5)


def test_draft_cache_is_compacted_to_the_accepted_path(tiny_family):
    from quickdraft.drafters import DraftModelDrafter
    from quickdraft.drafters.shapes import StaticTree

    draft, fresh = load_model(tiny_family["perturbed"]), load_model(tiny_family["perturbed"])
    drafter = DraftModelDrafter(draft, draft.vocab_size, StaticTree((2, 2, 2), sample=False))
    prompt = torch.tensor([3, 17, 42, 8, 99, 23])
    drafter.join(0, prompt, SamplingParams(), torch.Generator(), 64)
    [proposal] = drafter.propose([0], [prompt], [3])
    assert proposal.size == 14 and not proposal.is_chain
    leaf = 13  # the last node: depth 3, second child of a second child of the root's second child
    path = []
    while leaf >= 0:
        path.insert(0, leaf)
        leaf = int(proposal.parents[leaf])
    assert len(path) == 3 and path[0] == 1
    drafter.verified(0, prompt.numel(), path)
    assert draft.length == prompt.numel() + 2  # the depth-3 node was never fed to the draft
    fresh.reset(64)
    sequence = torch.cat([prompt, proposal.tokens[path], torch.tensor([5])])
    want = fresh.extend(sequence)[-1]
    got = draft.extend(sequence[draft.length:])[-1]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_hf_backend_refuses_trees_with_one_line(tiny_family):
    hf = load_model(tiny_family["target"], backend="hf")
    ids = torch.tensor([3, 4, 5])
    with pytest.raises(ValueError, match="chains only"):
        run(hf, ids, 10, make_drafter("tree", load_model(tiny_family["copy"]), hf.vocab_size), 3)


@pytest.mark.parametrize("args,message", [
    (["--tree", "2,x"], "not a tree shape"),
    (["--tree", "dynamic:0"], "not a tree shape"),
    (["--num-drafts", "0"], "positive integer"),
    (["--method", "multi-draft", "--multi-draft-rule", "spectr"], "needs sampling"),
    (["--method", "ngram", "--ngram-min", "4"], "ngram-min"),
])
def test_bad_method_settings_are_one_line_errors(tiny_family, capsys, args, message):
    try:
        code = main(["generate", "--model", str(tiny_family["target"]), "--prompt", "x", *args])
    except SystemExit as exc:  # argparse's own checks exit directly
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1


def test_method_needing_a_draft_without_one(tiny_family, capsys):
    for method in ("tree", "multi-draft", "hybrid"):
        code = main(["generate", "--model", str(tiny_family["target"]), "--prompt", "x", "--method", method])
        err = capsys.readouterr().err
        assert code == 2 and "draft" in err and len(err.strip().splitlines()) == 1
    # ngram needs none.
    assert main(["generate", "--model", str(tiny_family["target"]), "--prompt", "x", "--method", "ngram",
                 "--max-new-tokens", "4", "--json"]) == 0


def test_show_tree_draws_the_first_proposal(tiny_family, capsys):
    code = main(["generate", "--model", str(tiny_family["target"]), "--draft", str(tiny_family["copy"]),
                 "--prompt", "def add(a, b):", "--method", "tree", "--tree", "2,2", "--max-new-tokens", "6",
                 "--show-tree", "--json"])
    err = capsys.readouterr().err
    assert code == 0
    lines = err.strip().splitlines()
    assert lines[0].startswith("proposal: 6 nodes, depth 2, accepted 2")
    assert len(lines) == 7 and sum("[x]" in line for line in lines[1:]) == 2  # a copy draft: all of a path


def test_dynamic_tree_scores_fit_fresh_caches(tiny_family):
    """A dynamic tree scores at most its n nodes: fresh models' caches (sized for the
    sequence + the verify width) hold them even when k allows many more levels."""
    target, draft = load_model(tiny_family["target"]), load_model(tiny_family["perturbed"])
    ids = torch.tensor([5, 9, 11, 30])
    reference = run(load_model(tiny_family["target"]), ids, 12)
    drafter = make_drafter("tree", draft, target.vocab_size, DraftOptions(tree="dynamic:6"))
    assert run(target, ids, 12, drafter, k=7) == reference


def test_compaction_works_on_a_cache_allocated_in_inference_mode():
    """A cache first allocated inside inference mode (e.g. by the bench's step-cost timing)
    is an inference tensor; compacting a tree step outside it must still work."""
    from quickdraft.models.config import ModelConfig
    from quickdraft.models.kv_cache import KVCache

    cfg = ModelConfig(family="llama", model_type="llama", vocab_size=16, hidden_size=8, n_layers=1, n_heads=2,
                      n_kv_heads=1, head_dim=4, intermediate_size=8, max_position_embeddings=16)
    with torch.inference_mode():
        cache = KVCache(cfg, 1, 8)
        cache.k[0, 0, 0, :, 0] = torch.arange(8.0)
    cache.move(torch.tensor([5, 6]), 2)
    assert cache.k[0, 0, 0, :, 0].tolist() == [0, 1, 5, 6, 4, 5, 6, 7]
