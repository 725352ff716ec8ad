"""Layer skip (--method layer-skip): the target drafts for itself with sub-layers skipped.

Greedy output equals plain decoding for random skip profiles (every policy, chains and
trees); the target's KV cache after layer-skip steps equals a fresh prefill (the draft's
perturbed entries are never reused); sampled output has exactly the target's distribution,
and a wrong acceptance rule fails the same test; bad profiles are one-line errors."""

import random

import pytest
import torch
from test_sampling_exact import PROMPT, VOCAB, NoResidual, empirical_pvalue

from quickdraft.cli import main
from quickdraft.decoding.engine import decode
from quickdraft.decoding.sampling import SamplingParams
from quickdraft.decoding.stats import GenerationStats
from quickdraft.decoding.stopping import StopConditions
from quickdraft.drafters import DraftModelDrafter, DraftOptions, make_drafter
from quickdraft.drafters.draft_stop import parse_draft_stop
from quickdraft.drafters.layer_skip import LayerSkipLM, SkipProfile, model_fingerprint
from quickdraft.models.config import ModelConfig
from quickdraft.models.lm import NativeLM, load_model
from quickdraft.models.transformer import Transformer

PROMPTS = ["def add(a, b):", "class Point:\n    def", "x"]


def run(target, ids, n, drafter=None, k=4, stats=None, params=SamplingParams()):
    steps = decode(target, ids, StopConditions(n, ()), drafter=drafter, num_speculative_tokens=k,
                   stats=stats, params=params)
    return [t for s in steps for t in s.tokens]


def profile_for(lm, attn, mlp, k=4):
    return SkipProfile("test", model_fingerprint(lm.model_dir), lm.config.n_layers, attn, mlp, k)


@pytest.fixture(scope="module")
def deep(tiny_family, tmp_path_factory):
    """A 4-layer target with the tiny family's tokenizer (more profiles than 2 layers give)."""
    from conftest import save_llama
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("deep")
    tok = AutoTokenizer.from_pretrained(tiny_family["target"])
    save_llama(path, len(tok), 4, 64, 3, tok.eos_token_id, scale=20.0)
    tok.save_pretrained(path)
    return tok, load_model(path)


@pytest.mark.slow
def test_random_profiles_keep_greedy_output_equal_to_plain(deep):
    tok, target = deep
    rng = random.Random(0)
    layers = range(target.config.n_layers)
    profiles = [([], []), (list(layers), list(layers))]  # nothing skipped; everything skipped
    profiles += [([i for i in layers if rng.random() < 0.5], [i for i in layers if rng.random() < 0.5])
                 for _ in range(3)]
    for prompt in PROMPTS[:2]:
        ids = torch.tensor(tok(prompt)["input_ids"])
        reference = run(target, ids, 24)
        for n, (attn, mlp) in enumerate(profiles):
            for spec, k in (("fixed", 3), ("dv", 8))[: 1 + n % 2]:
                drafter = DraftModelDrafter(LayerSkipLM(target, profile_for(target, attn, mlp)), target.vocab_size,
                                            stop=parse_draft_stop(spec))
                assert run(target, ids, 24, drafter, k) == reference, (prompt, attn, mlp, spec)
    # Trees work on the same view (the draft shares the target's cache, tree slots included).
    profile = profile_for(target, [1], [2])
    ids = torch.tensor(tok(PROMPTS[0])["input_ids"])
    draft = LayerSkipLM(target, profile)
    for options in (DraftOptions(tree="2,2,1"), DraftOptions(tree="dynamic:5")):
        assert run(target, ids, 24, make_drafter("tree", draft, target.vocab_size, options), 3) == run(target, ids, 24)


def test_nothing_skipped_is_the_target_itself(deep):
    """With an empty profile the draft is the target: every draft is accepted."""
    tok, target = deep
    stats = GenerationStats()
    drafter = DraftModelDrafter(LayerSkipLM(target, profile_for(target, [], [])), target.vocab_size)
    run(target, torch.tensor(tok(PROMPTS[0])["input_ids"]), 30, drafter, 4, stats)
    assert stats.acceptance_rate == 1.0


def test_target_cache_equals_a_fresh_prefill_after_layer_skip_steps(deep):
    tok, target = deep
    ids = torch.tensor(tok(PROMPTS[1])["input_ids"])
    drafter = DraftModelDrafter(LayerSkipLM(target, profile_for(target, [0, 2], [1, 3])), target.vocab_size)
    for n in (5, 17, 30):
        out = run(target, ids, n, drafter, 4)
        length = target.length
        sequence = torch.cat([ids, torch.tensor(out)])[:length]
        fresh = target.model.new_cache(1, length)
        with torch.no_grad():
            target.model(sequence[None], torch.arange(length)[None], fresh, logits="none")
        torch.testing.assert_close(target.cache.k[:, :, :, :length], fresh.k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(target.cache.v[:, :, :, :length], fresh.v, atol=1e-5, rtol=1e-5)


def tiny_deep_lm() -> NativeLM:
    config = ModelConfig(
        family="llama", model_type="llama", vocab_size=VOCAB, hidden_size=16, n_layers=2, n_heads=2,
        n_kv_heads=2, head_dim=8, intermediate_size=32, max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = Transformer(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
        model.lm_head.weight.mul_(3.0)
    return NativeLM(model.eval())


TINY = tiny_deep_lm()
SKIP_DRAFTER = DraftModelDrafter(LayerSkipLM(TINY, SkipProfile("tiny", "", 2, [1], [0])), VOCAB)


@pytest.mark.slow
def test_layer_skip_sampling_matches_target_distribution():
    assert empirical_pvalue(TINY, SKIP_DRAFTER, SamplingParams(temperature=1.0), n_samples=1200) > 1e-3


@pytest.mark.slow
def test_wrong_rule_fails_the_same_layer_skip_test():
    assert empirical_pvalue(TINY, SKIP_DRAFTER, SamplingParams(temperature=1.0), NoResidual, n_samples=500) < 1e-6


def test_prompt_shape_is_what_the_sampling_test_expects():
    assert PROMPT.numel() > 1  # the skip draft's prefill hands the prompt to the target


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.update(n_layers=3), "is for a 3-layer model"),
    (lambda d: d.update(skip_mlp=[0, 9]), "skips layer 9"),
    (lambda d: d.update(fingerprint="0123456789abcdef"), "was tuned for another model"),
    (lambda d: d.pop("skip_attn"), "is not a skip profile"),
])
def test_bad_profiles_are_one_line_errors(deep, tmp_path, capsys, edit, message):
    tok, target = deep
    data = profile_for(target, [0], [1]).to_json()
    edit(data)
    path = tmp_path / "profile.json"
    import json

    path.write_text(json.dumps(data))
    code = main(["generate", "--model", str(target.model_dir), "--method", "layer-skip", "--skip-profile", str(path),
                 "--prompt", "x", "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_bad_draft_stop_and_missing_profile_are_one_line_errors(deep, tmp_path, capsys):
    tok, target = deep
    for args, message in (
        (["--method", "draft", "--draft-stop", "often"], "is not a policy"),
        (["--method", "tree", "--draft-stop", "dv"], "stops chains"),
        (["--method", "layer-skip"], "no skip profile"),
        (["--method", "layer-skip", "--skip-profile", str(tmp_path / "none.json")], "does not exist"),
    ):
        code = main(["generate", "--model", str(target.model_dir), *args, "--prompt", "x", "--max-new-tokens", "4"])
        err = capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (args, err)
