"""--device / --dtype: resolved in one place, refused in one line, and bfloat16 decoding on
the CPU is lossless against bfloat16 plain decoding (with our bfloat16 products where the
CPU has AVX512_BF16, tests/test_bf16_products.py; else PyTorch's bfloat16 ops)."""

import pytest
import torch

from quickdraft.cli import main
from quickdraft.decoding.engine import decode
from quickdraft.decoding.sampling import SamplingParams
from quickdraft.decoding.stopping import StopConditions
from quickdraft.drafters import DraftModelDrafter
from quickdraft.generator import SpeculativeGenerator
from quickdraft.models import cpu_kernels
from quickdraft.models.decode_linear import DecodeLinear
from quickdraft.models.lm import load_model
from quickdraft.models.placement import Placement, PlacementError, resolve_placement

BF16 = Placement(torch.device("cpu"), torch.bfloat16)
PROMPTS = ["def add(a, b):", "class Point:\n    def", "for i in range(10):\n    print(i"]


def test_defaults_and_names():
    assert resolve_placement() == Placement(torch.device("cpu"), torch.float32)
    assert resolve_placement("cpu", "auto").dtype == torch.float32
    assert resolve_placement("cpu", "bf16").dtype == torch.bfloat16
    assert resolve_placement("cpu", "float16").dtype == torch.float16
    assert resolve_placement(None, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("device, dtype, says", [
    ("cpu", "int8", "unknown dtype 'int8'"),
    ("tpu", "auto", "--device 'tpu' is not a torch device"),
    ("cuda:x", "auto", "is not a torch device"),
])
def test_bad_names_are_one_line(device, dtype, says):
    with pytest.raises(PlacementError, match=says) as err:
        resolve_placement(device, dtype)
    assert "\n" not in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_one_line_with_the_fix(capsys):
    with pytest.raises(PlacementError, match="no CUDA device is usable here.*--device cpu"):
        resolve_placement("cuda")
    # The CLI says it in one line and exits 2, before loading anything.
    assert main(["generate", "--prompt", "x", "--device", "cuda", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no CUDA device" in err and "--device cpu" in err
    assert main(["bench", "--quick", "--device", "cuda:1", "--methods", "ar"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no CUDA device" in err
    with pytest.raises(ValueError, match="no CUDA device"):
        SpeculativeGenerator.from_pretrained(device="cuda")


def test_bf16_weights_cache_and_logits_on_pytorch_ops(tiny_family, monkeypatch):
    """A CPU without AVX512_BF16 (or without our kernels): the model is bfloat16 throughout."""
    monkeypatch.setattr(cpu_kernels, "bf16_products_supported", lambda: False)
    lm = load_model(tiny_family["target"], placement=BF16)
    assert lm.model.embed.weight.dtype == torch.bfloat16 and not lm.decode_linears
    logits = lm.extend(torch.tensor([1, 2, 3]))
    assert lm.cache.k.dtype == torch.bfloat16 and logits.dtype == torch.bfloat16


@pytest.mark.skipif(not cpu_kernels.bf16_products_supported(), reason="this CPU lacks AVX512_BF16")
def test_bf16_on_our_products(tiny_family):
    """With AVX512_BF16: weights rounded to bfloat16 (kept as float32 tensors), the products'
    inputs rounded too, the cache, norms and logits float32."""
    lm = load_model(tiny_family["target"], placement=BF16)
    weight = lm.model.embed.weight
    assert lm.model.bf16_products and lm.decode_linears
    assert weight.dtype == torch.float32 and torch.equal(weight.bfloat16().float(), weight)
    assert {m.kind for m in lm.model.modules() if isinstance(m, DecodeLinear)} == {"bf16dp"}
    logits = lm.extend(torch.tensor([1, 2, 3]))
    assert lm.cache.k.dtype == torch.float32 and logits.dtype == torch.float32


def computes_in_bf16(model) -> bool:
    """PyTorch's bfloat16 ops, or our bfloat16 products (test_bf16_products.py)."""
    return model.embed.weight.dtype == torch.bfloat16 or getattr(model, "bf16_products", False)


def plain(target, ids, n):
    return [t for s in decode(target, ids, StopConditions(n)) for t in s.tokens]


#: bfloat16 keeps 8 significant bits: on PyTorch's bfloat16 ops a k+1-row verify pass and a
#: one-row step may round a logit differently (the CPU's bf16 matmul kernels depend on the
#: row count), so two logits closer than this may swap order. float32 and our bfloat16
#: products are exact (tests/test_engine.py, tests/test_bf16_products.py).
NEAR_TIE = 0.25


def top2_gap(target, ids: torch.Tensor, prefix: list[int]) -> float:
    """The gap between plain decoding's two best logits after ``ids`` + ``prefix``."""
    target.reset()
    logits = target.extend(torch.cat([ids, torch.tensor(prefix, dtype=torch.long)]), logits="last")[0].float()
    best = logits.topk(2).values
    return float(best[0] - best[1])


def assert_lossless_bf16(target, ids, got: list[int], want: list[int], what) -> int:
    """``got`` equals plain decoding's ``want``, or first differs where plain decoding's own
    two best logits are within bf16 rounding of each other. Returns the tokens compared."""
    if got == want:
        return len(want)
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    gap = top2_gap(target, ids, want[:at])
    assert gap < NEAR_TIE, f"{what}: diverges from plain decoding at token {at}, top-2 logit gap {gap:.3f}"
    return at


@pytest.mark.parametrize("k", [1, 3, 6])
def test_bf16_draft_chain_equals_bf16_plain(tiny_family, k):
    from quickdraft.pair import load_tokenizer

    tok = load_tokenizer(tiny_family["target"])
    target = load_model(tiny_family["target"], placement=BF16)
    draft = load_model(tiny_family["perturbed"], placement=BF16)
    for prompt in PROMPTS:
        ids = torch.tensor(tok(prompt)["input_ids"])
        steps = decode(target, ids, StopConditions(40), drafter=DraftModelDrafter(draft, target.vocab_size),
                       num_speculative_tokens=k)
        assert_lossless_bf16(target, ids, [t for s in steps for t in s.tokens], plain(target, ids, 40), (prompt, k))


@pytest.mark.parametrize("method", ["ngram", "tree", "hybrid"])
def test_bf16_methods_equal_bf16_plain_through_the_api(tiny_family, method):
    ar = SpeculativeGenerator.from_pretrained(tiny_family["target"], method="ar", dtype="bfloat16")
    gen = SpeculativeGenerator.from_pretrained(tiny_family["target"], tiny_family["perturbed"], method=method,
                                               dtype="bfloat16")
    assert computes_in_bf16(gen.target.model)
    for prompt in PROMPTS:
        want = ar.generate(prompt, max_new_tokens=40).token_ids
        got = gen.generate(prompt, max_new_tokens=40, num_speculative_tokens=4).token_ids
        assert_lossless_bf16(ar.target, ar.encode(prompt), got, want, (method, prompt))


def test_cli_generate_in_bf16_equals_plain(tiny_family, capsys):
    import json

    def run(*extra):
        code = main(["generate", "--model", str(tiny_family["target"]), "--draft", str(tiny_family["perturbed"]),
                     "--prompt", "def add(a, b):", "--max-new-tokens", "24", "-k", "3", "--json",
                     "--dtype", "bfloat16", *extra])
        assert code == 0
        return json.loads(capsys.readouterr().out)["token_ids"]

    spec, ar = run(), run("--method", "ar")
    assert spec[:12] == ar[:12]  # (the first divergence of these prompts is later, if any)


# The sampled chi-square test (tests/test_sampling_exact.py's harness) in bfloat16: the
# models compute in bf16, the acceptance rule in float32, and output is distributed as
# the bf16 target's own distribution.
BF16_SAMPLES = 1200


def bf16_pair():
    from test_sampling_exact import VOCAB, tiny_lm

    return tiny_lm(0, 3.0, dtype=torch.bfloat16), DraftModelDrafter(tiny_lm(1, 3.0, dtype=torch.bfloat16), VOCAB)


@pytest.mark.slow
def test_bf16_speculative_sampling_matches_the_bf16_target():
    from test_sampling_exact import empirical_pvalue

    target, drafter = bf16_pair()
    assert target.model.embed.weight.dtype == torch.bfloat16
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
    assert empirical_pvalue(target, drafter, params, n_samples=BF16_SAMPLES) > 1e-3


@pytest.mark.slow
def test_bf16_wrong_rule_fails_the_same_test():
    from test_sampling_exact import NoResidual, empirical_pvalue

    target, drafter = bf16_pair()
    assert empirical_pvalue(target, drafter, SamplingParams(temperature=1.0), NoResidual,
                            n_samples=BF16_SAMPLES) < 1e-4
