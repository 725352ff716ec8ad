"""The fixed-width step that CUDA graphs capture (models/static_step.py), run eagerly on
the CPU: its logits are the ordinary pass's, its padding rows never leak into the output,
and greedy decoding through it (plain and speculative) is plain decoding's output."""

import pytest
import torch

from quickdraft.generator import SpeculativeGenerator
from quickdraft.models.lm import load_model
from quickdraft.models.static_step import StaticStep

PROMPTS = ["def add(a, b):", "class Point:\n    def", "for i in range(10):\n    print(i"]


def test_static_step_logits_equal_the_ordinary_pass(tiny_family):
    ordinary, static = load_model(tiny_family["target"]), load_model(tiny_family["target"])
    static.use_static_step(5)
    ordinary.reset(64)
    static.reset(64)
    assert isinstance(static.static, StaticStep) and static.cache.max_len >= 64 + 5
    prompt = torch.tensor([3, 9, 27, 81, 5, 7, 11])
    ordinary.extend(prompt, logits="none")
    static.extend(prompt, logits="none")  # longer than the width: the ordinary pass
    for feed in ([1], [2, 3], [4, 5, 6, 7, 8], [9, 10, 11]):  # then fixed-width steps, padded
        tokens = torch.tensor(feed)
        want, got = ordinary.extend(tokens), static.extend(tokens)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    ordinary.crop(ordinary.length - 2)  # a rejected draft: roll back, then the step overwrites it
    static.crop(static.length - 2)
    torch.testing.assert_close(static.extend(torch.tensor([12, 13]), logits=1),
                               ordinary.extend(torch.tensor([12, 13]), logits=1), rtol=1e-4, atol=1e-4)


def test_longer_generations_reuse_the_static_step(tiny_family):
    """Each cache size is a separate compiled graph on a GPU (an H200 recompiled when a
    128-token run followed an 8-token warm-up): the cache grows in powers of two."""
    lm = load_model(tiny_family["target"])
    lm.use_static_step(5)
    lm.reset(40)
    step, size = lm.static, lm.cache.max_len
    assert size == 64
    for longer in (41, 50, 59):
        lm.reset(longer)
        assert lm.static is step and lm.cache.max_len == size
    lm.reset(60)  # past the bucket: the next power of two
    assert lm.static is not step and lm.cache.max_len == 128


def test_the_static_step_traces_as_one_graph(tiny_family):
    """A graph break splits the captured step into several CUDA graphs with Python between
    them (an H200 run broke it at the RoPE table's is_inference() check)."""
    lm = load_model(tiny_family["target"])
    lm.use_static_step(4)
    lm.reset(32)
    lm.extend(torch.tensor([3, 9, 27]), logits="none")
    with torch.inference_mode():
        explanation = torch._dynamo.explain(lm.static._step)(lm.static.tokens, lm.static.start)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("method", ["ar", "draft", "ngram"])
def test_greedy_through_the_static_step_is_plain_decoding(tiny_family, method):
    plain = SpeculativeGenerator.from_pretrained(tiny_family["target"], method="ar")
    gen = SpeculativeGenerator.from_pretrained(tiny_family["target"], tiny_family["perturbed"], method=method,
                                               capture=True)
    for prompt in PROMPTS:
        want = plain.generate(prompt, max_new_tokens=40).token_ids
        assert gen.generate(prompt, max_new_tokens=40, num_speculative_tokens=3).token_ids == want, prompt
    assert gen.target.static is not None and gen.target.static.width == (1 if method == "ar" else 4)
    if method == "draft":  # the draft's own chain steps run at a fixed width too
        assert gen.draft.static is not None and gen.draft.static.width == 2


def test_capture_needs_the_native_runtime(tiny_family):
    with pytest.raises(ValueError, match="capture needs the native runtime"):
        SpeculativeGenerator.from_pretrained(tiny_family["target"], method="ar", backend="hf", capture=True)


@pytest.mark.parametrize("compile, mode", [(True, "reduce-overhead"), ("max-autotune", "max-autotune")])
def test_the_compiled_step_takes_a_compile_mode(tiny_family, monkeypatch, compile, mode):
    """``use_static_step(w, compile=True)`` captures with CUDA graphs (reduce-overhead); a
    mode by name is passed on (``gpu_roofline.py --capture-mode max-autotune`` tunes the
    matrix kernels too). torch.compile itself is not run here: its mode is what is checked."""
    seen = []

    def recording_compile(fn, mode=None, dynamic=None):
        seen.append(mode)
        return fn  # the step as it is: eager, same results

    monkeypatch.setattr(torch, "compile", recording_compile)
    lm = load_model(tiny_family["target"])
    lm.use_static_step(2, compile=compile)
    lm.reset(32)
    lm.extend(torch.tensor([3, 9, 27]), logits="none")
    lm.extend(torch.tensor([5]))
    assert seen == [mode]
