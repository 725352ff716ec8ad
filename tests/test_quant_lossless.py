"""Speculative decoding stays lossless relative to a quantized target: greedy output equals
plain decoding with the same int4/int8 target, and sampled output keeps its distribution."""

from __future__ import annotations

import pytest
import torch
from gguf_files import write_tiny_gguf
from test_sampling_exact import VOCAB, NoResidual, empirical_pvalue, tiny_transformer

from quickdraft.decoding.engine import decode
from quickdraft.decoding.sampling import SamplingParams
from quickdraft.decoding.stopping import StopConditions
from quickdraft.drafters import DraftModelDrafter
from quickdraft.drafters.ngram import NgramDrafter
from quickdraft.drafters.shapes import StaticTree
from quickdraft.models.lm import NativeLM, load_model
from quickdraft.models.placement import resolve_placement
from quickdraft.models.quant_linear import (
    Int4Linear,
    Int8Linear,
    kernels_available,
    quantize_linears,
)

pytestmark = pytest.mark.skipif(not kernels_available(), reason="this torch lacks the CPU int4/int8 kernels")
PROMPTS = [torch.tensor([5, 17, 200, 3, 99, 42, 7, 260, 1, 64]), torch.tensor([40, 41, 42, 40, 41, 42, 40])]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These products are tiny: on a loaded 2-core machine, a second thread's hand-offs
    cost 20x the arithmetic (measured: 180 instead of 9 ms a decode)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    """A Q4_1 target (its linears int4 straight from the file's blocks) and a Q8_0 draft."""
    root = tmp_path_factory.mktemp("quant")
    write_tiny_gguf(root / "target.gguf", "Q4_1", seed=0)
    write_tiny_gguf(root / "draft.gguf", "Q8_0", seed=0)  # same weights, other rounding: ~agrees
    target = load_model(root / "target.gguf", placement=resolve_placement(quantize="int4"))
    assert isinstance(target.model.layers[0].attn.wqkv, Int4Linear)
    return target, load_model(root / "draft.gguf", placement=resolve_placement(quantize="none"))


def tokens(steps) -> list[int]:
    return [t for s in steps for t in s.tokens]


@pytest.mark.parametrize("method", ["draft", "tree", "ngram"])
def test_greedy_speculative_equals_plain_with_an_int4_target(gguf_pair, method):
    target, draft = gguf_pair
    for prompt in PROMPTS:
        reference = tokens(decode(target, prompt, StopConditions(20)))
        for k in (1, 4, 8):
            if method == "ngram":
                drafter = NgramDrafter()
            else:
                drafter = DraftModelDrafter(draft, target.vocab_size, StaticTree((2, 2, 1)) if method == "tree" else None)
            out = tokens(decode(target, prompt, StopConditions(20), drafter=drafter, num_speculative_tokens=k))
            assert out == reference, (method, prompt.tolist(), k)


def test_greedy_int8_trees_equal_plain(tmp_path):
    """8-bit activations magnify any rounding difference between a tree node and the plain
    step that later sees the same keys, so a node must round exactly as that step does
    (this model and prompt diverged at token 76 when the softmax summed keys by slot)."""
    write_tiny_gguf(tmp_path / "m.gguf", "F32", seed=2)
    target = load_model(tmp_path / "m.gguf", placement=resolve_placement(quantize="int8"))
    draft = load_model(tmp_path / "m.gguf")
    prompt = torch.randint(0, 250, (12,), generator=torch.Generator().manual_seed(0))
    reference = tokens(decode(target, prompt, StopConditions(100)))
    for shape in ((3, 2, 2, 1), (4, 3, 2, 2, 1, 1)):
        tree = DraftModelDrafter(draft, target.vocab_size, StaticTree(shape))
        out = tokens(decode(target, prompt, StopConditions(100), drafter=tree, num_speculative_tokens=len(shape)))
        assert out == reference, shape


def test_greedy_speculative_equals_plain_with_an_int8_target(tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf", "F32", seed=3)
    target = load_model(tmp_path / "m.gguf", placement=resolve_placement(quantize="int8"))
    draft = load_model(tmp_path / "m.gguf")  # the float32 model drafts for its int8 self
    assert isinstance(target.model.layers[1].mlp.w_out, Int8Linear)
    for prompt in PROMPTS:
        reference = tokens(decode(target, prompt, StopConditions(20)))
        out = tokens(decode(target, prompt, StopConditions(20), drafter=DraftModelDrafter(draft, target.vocab_size),
                            num_speculative_tokens=6))
        assert out == reference


def quantized_tiny_lm(seed: int, mode: str) -> NativeLM:
    """test_sampling_exact's tiny target, wide enough for int4 groups (32 columns)."""
    model = tiny_transformer(seed, 3.0, width=32)
    assert quantize_linears(model, mode) == 4
    return NativeLM(model.eval())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_sampled_speculative_output_keeps_the_quantized_targets_distribution(mode):
    target = quantized_tiny_lm(0, mode)
    drafter = DraftModelDrafter(quantized_tiny_lm(1, mode), VOCAB)  # another model: many rejections
    assert empirical_pvalue(target, drafter, SamplingParams(temperature=1.0), n_samples=2000) > 1e-3


@pytest.mark.slow
def test_a_wrong_rule_fails_through_the_quantized_path():
    target = quantized_tiny_lm(0, "int4")
    drafter = DraftModelDrafter(quantized_tiny_lm(1, "int4"), VOCAB)
    assert empirical_pvalue(target, drafter, SamplingParams(temperature=1.0), NoResidual, n_samples=2000) < 1e-6


def test_beside_a_quantized_target_auto_stores_the_draft_in_int8_and_stays_lossless(tmp_path):
    """``--quantize auto`` on a Q4 file quantizes the target (the file's blocks) and, where our
    kernels run, its draft in int8: a float32 draft step would weigh on every speculative
    step. The draft's rounding changes its proposals, never the target's output."""
    from quickdraft.models.quant_linear import native_kernels
    from quickdraft.pair import load_pair

    write_tiny_gguf(tmp_path / "target.gguf", "Q4_1", seed=0)
    write_tiny_gguf(tmp_path / "draft.gguf", "F32", seed=0)
    pair = load_pair(tmp_path / "target.gguf", tmp_path / "draft.gguf")
    quantized = native_kernels()
    assert isinstance(pair.target.model.layers[0].attn.wqkv, Int4Linear) == quantized
    assert isinstance(pair.draft.model.layers[0].mlp.w_out, Int8Linear) == quantized
    # --quantize none leaves both float.
    plain_pair = load_pair(tmp_path / "target.gguf", tmp_path / "draft.gguf", placement=resolve_placement(quantize="none"))
    assert not isinstance(plain_pair.draft.model.layers[0].mlp.w_out, Int8Linear)
    for prompt in PROMPTS:
        reference = tokens(decode(pair.target, prompt, StopConditions(20)))
        out = tokens(decode(pair.target, prompt, StopConditions(20),
                            drafter=DraftModelDrafter(pair.draft, pair.target.vocab_size), num_speculative_tokens=4))
        assert out == reference
