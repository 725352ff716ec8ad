"""The shipped model family: registry, native runtime, transformers, tokenizer."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from quickdraft.generator import SpeculativeGenerator
from quickdraft.models.loading import load_native
from quickdraft.models.registry import default_target, list_models, paired_draft

TEXT = "def área(r):\n    return 3.14159 * r ** 2  # ∑ 🙂 naïve\n\tclass X: pass\r\n"


def test_registry_lists_a_default_target_with_its_draft():
    target = default_target()
    assert target is not None and target.role == "target" and target.params >= 12_000_000
    draft = paired_draft(target)
    assert draft is not None and draft.role == "draft"
    assert {m.name for m in list_models()} >= {target.name, draft.name}


def test_native_runtime_matches_transformers_on_embedded_models():
    ids = AutoTokenizer.from_pretrained(default_target().path)("import os\ndef main():\n")["input_ids"]
    ids = torch.tensor([ids])
    for model in (default_target(), paired_draft(default_target())):
        native = load_native(model.path)
        hf = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()
        with torch.no_grad():
            ours = native(ids, torch.arange(ids.shape[1])[None], native.new_cache(1, 64)).logits
            torch.testing.assert_close(ours, hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_tokenizer_round_trips_exactly():
    tok = AutoTokenizer.from_pretrained(default_target().path)
    assert tok.decode(tok(TEXT)["input_ids"]) == TEXT


def test_default_pair_is_lossless_and_accepts_drafts():
    gen = SpeculativeGenerator.from_pretrained()
    plain = SpeculativeGenerator(gen.target, gen.tokenizer)
    prompt = 'def median(values):\n    """Return the median of a list."""\n'
    spec = gen.generate(prompt, max_new_tokens=48)
    assert spec.token_ids == plain.generate(prompt, max_new_tokens=48).token_ids
    assert spec.stats.mean_accepted_tokens > 1.5  # a distilled draft is right often
