"""The Python API: explicit keyword parameters, the stream handle, shared helpers."""

from __future__ import annotations

from types import SimpleNamespace

from quickdraft.models.lm import eos_token_ids


def test_eos_token_ids_merges_target_and_tokenizer_once():
    target = SimpleNamespace(eos_token_ids=[2, 0, 2])
    assert eos_token_ids(target, SimpleNamespace(eos_token_id=0)) == [2, 0]
    assert eos_token_ids(target, SimpleNamespace(eos_token_id=7)) == [2, 0, 7]
    assert eos_token_ids(target, SimpleNamespace(eos_token_id=None)) == [2, 0]
    assert eos_token_ids(target, None) == [2, 0]
    assert eos_token_ids(SimpleNamespace(eos_token_ids=[]), SimpleNamespace(eos_token_id=3)) == [3]


def test_stats_merge_pools_counts_and_positions():
    from quickdraft.decoding.stats import GenerationStats

    a, b = GenerationStats(), GenerationStats()
    a.record_step(3, 2)
    a.new_tokens, a.decode_seconds = 3, 0.5
    b.record_step(5, 5)
    b.record_step(1, 0)
    b.new_tokens, b.decode_seconds = 7, 0.25
    assert a.merge(b) is a
    assert (a.new_tokens, a.target_forward_passes, a.drafted_tokens, a.accepted_tokens) == (10, 3, 9, 7)
    assert a.drafted_per_position == [3, 2, 2, 1, 1] and a.accepted_per_position == [2, 2, 1, 1, 1]
    assert a.decode_seconds == 0.75
    empty = GenerationStats().merge(b)
    assert empty.drafted_per_position == b.drafted_per_position


# --- the generator API ---------------------------------------------------------------------

import inspect  # noqa: E402

import pytest  # noqa: E402

from quickdraft import GenerationStats, SamplingParams, SpeculativeGenerator  # noqa: E402
from quickdraft.text import TextStream  # noqa: E402

OPTIONS = ["max_new_tokens", "temperature", "top_k", "top_p", "seed", "num_speculative_tokens", "stop",
           "truncate_prompt", "sampling"]


@pytest.fixture(scope="module")
def gen(tiny_family):
    return SpeculativeGenerator.from_pretrained(tiny_family["target"], tiny_family["perturbed"])


@pytest.mark.parametrize("name", ["generate", "stream"])
def test_options_are_explicit_documented_keywords(name):
    method = getattr(SpeculativeGenerator, name)
    params = inspect.signature(method).parameters
    for option in OPTIONS:
        assert option in params and params[option].kind is inspect.Parameter.KEYWORD_ONLY, option
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    doc = inspect.getdoc(method)
    assert all(option in doc for option in ("temperature", "stop", "num_speculative_tokens")) or name == "stream"
    assert "generate" in doc  # stream's docstring refers to generate's parameters


def test_help_shows_the_options():
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        help(SpeculativeGenerator.generate)
    text = buf.getvalue()
    assert "temperature: 'float' = 0.0" in text or "temperature: float = 0.0" in text
    assert "top_p" in text and "truncate_prompt" in text


def test_sampling_keywords_equal_a_sampling_params(gen):
    a = gen.generate("def add(a, b):", max_new_tokens=12, temperature=0.7, top_k=20, top_p=0.9, seed=4)
    b = gen.generate("def add(a, b):", max_new_tokens=12,
                     sampling=SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=4))
    assert a.token_ids == b.token_ids and a.text == b.text
    with pytest.raises(ValueError, match="not both"):
        gen.generate("x", temperature=0.7, sampling=SamplingParams(temperature=0.7))


def test_a_single_stop_string_is_not_a_set_of_characters(gen):
    full = gen.generate("class Point:", max_new_tokens=30, num_speculative_tokens=3).text
    stop = full[12:15]
    cut = gen.generate("class Point:", max_new_tokens=30, num_speculative_tokens=3, stop=stop)
    assert cut.text == full[: full.index(stop)]
    assert cut.text == gen.generate("class Point:", max_new_tokens=30, stop=[stop]).text


def test_stream_exposes_its_stats_and_result(gen):
    ref = gen.generate("for i in range(10):", max_new_tokens=25, num_speculative_tokens=3)
    stream = gen.stream("for i in range(10):", max_new_tokens=25, num_speculative_tokens=3)
    assert isinstance(stream, TextStream) and isinstance(stream.stats, GenerationStats)
    assert stream.stats.prompt_tokens > 0 and not stream.finished  # known before the first chunk
    text = "".join(chunk.text for chunk in stream)
    assert stream.finished and text == stream.text == ref.text
    assert stream.token_ids == ref.token_ids
    assert stream.stats.new_tokens == ref.stats.new_tokens == len(ref.token_ids)
    assert stream.stats.finish_reason == ref.stats.finish_reason != ""
    result = gen.stream("for i in range(10):", max_new_tokens=25, num_speculative_tokens=3).result()
    assert result.text == ref.text and result.token_ids == ref.token_ids


BAD_ARGUMENTS = [  # each used to fail deep inside the engine, or crash the process
    (dict(prompt=[10**7]), ValueError, r"token id 10000000 is outside the model's vocabulary \[0, \d+\)"),
    (dict(prompt=[5, -1]), ValueError, "token id -1 is outside"),
    (dict(prompt=["def f():", [10**7]]), ValueError, "token id 10000000 is outside"),  # a batch's row
    (dict(prompt=5), TypeError, "a prompt is text or a sequence of token ids, got int"),
    (dict(prompt=[1.5, 2.0]), TypeError, "got float"),
    (dict(prompt=["x", 5]), TypeError, "got int"),
    (dict(prompt="x", max_new_tokens=3.5), TypeError, "max_new_tokens must be an integer, got 3.5"),
    (dict(prompt="x", temperature=0.5, seed="a"), TypeError, "seed must be an integer or None"),
    (dict(prompt="x", temperature="0.5"), TypeError, "temperature must be a number"),
    (dict(prompt="x", temperature=1e308), ValueError, r"temperature must be in \[0, 100\]"),  # NaN otherwise
    (dict(prompt="x", stop=5), TypeError, "stop must be a string or a list of strings"),
    (dict(prompt="x", stop=["ok", 1]), TypeError, "stop must be a string or a list of strings"),
    (dict(prompt="x", num_speculative_tokens=1.5), TypeError, "num_speculative_tokens must be an integer, got 1.5"),
    (dict(prompt=["x", "y"], batch_size=1.5), TypeError, "batch_size must be an integer, got 1.5"),
]


@pytest.mark.parametrize("kwargs,error,message", BAD_ARGUMENTS)
def test_bad_arguments_name_what_is_wrong(gen, kwargs, error, message):
    with pytest.raises(error, match=message):
        gen.generate(**{"max_new_tokens": 4, **kwargs})


def test_setting_k_checks_it_and_none_settles_it_again(tiny_family, private_cache_dir):
    gen = SpeculativeGenerator.from_pretrained(tiny_family["target"], tiny_family["perturbed"])
    gen.num_speculative_tokens = 3
    assert gen.settled_k() == 3
    for bad, error in ((-1, ValueError), (2.5, TypeError), ("3", TypeError)):
        with pytest.raises(error, match="num_speculative_tokens must be"):
            gen.num_speculative_tokens = bad
    assert gen.num_speculative_tokens == 3  # a refused value changes nothing
    gen.num_speculative_tokens = None  # made later generations fail on `None > 0`
    assert gen.generate("def f():", max_new_tokens=4).token_ids  # settled again
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 0"):
        SpeculativeGenerator(gen.target, gen.tokenizer, num_speculative_tokens=-2)


def test_token_ids_may_be_a_tensor_or_a_list(gen):
    import torch

    listed = gen.generate([5, 6, 7], max_new_tokens=6, num_speculative_tokens=2)
    assert gen.generate(torch.tensor([5, 6, 7]), max_new_tokens=6, num_speculative_tokens=2).token_ids == listed.token_ids
    with pytest.raises(TypeError, match="1-D integer tensor"):
        gen.generate(torch.tensor([[5, 6]]), max_new_tokens=4)


def test_stream_raises_for_a_prompt_that_does_not_fit(gen):
    from quickdraft import ContextOverflowError

    with pytest.raises(ContextOverflowError):
        gen.stream("x = 1\n" * 400)  # raised by stream() itself, before iterating
    stream = gen.stream("x = 1\n" * 400, truncate_prompt=True, max_new_tokens=4)
    assert stream.stats.truncated_prompt_tokens > 0
    assert stream.stats.prompt_tokens + 4 <= gen.target.context_length
    assert len(stream.result().token_ids) == 4


def test_default_k_is_the_generators_and_tuning_sets_it(gen, private_cache_dir):
    choice = gen.tune_num_speculative_tokens()
    # k = 0 (no draft) when the tiny pair is predicted slower than plain decoding.
    assert gen.num_speculative_tokens == choice.k and 0 <= choice.k <= 8 and 1 <= choice.best_k <= 8
    assert choice.path is not None and choice.path.is_relative_to(private_cache_dir)
    again = gen.tune_num_speculative_tokens()
    assert not again.measured and again.k == choice.k


def test_the_first_generation_settles_k_with_the_cost_model(tiny_family, private_cache_dir):
    """An API user who never calls resolve_k() decodes with the cost model's k, not the
    method's default (EAGLE on SmolLM2: a chain of 6, slower than plain decoding); a k the
    user gave, to the constructor, the attribute or a call, is never replaced."""
    from quickdraft.policy.autok import cached_k

    heard = []
    gen = SpeculativeGenerator.from_pretrained(tiny_family["target"], tiny_family["unrelated"], log=heard.append)
    assert gen.num_speculative_tokens == 4  # the default until settled
    gen.generate("def f(x):", max_new_tokens=4)
    choice = cached_k(gen.target, gen.drafter.model, gen.tokenizer)
    assert not choice.measured  # the first generation measured it (and cached it)
    assert gen.num_speculative_tokens == choice.k and heard  # and its summary line
    gen.num_speculative_tokens = 7  # set by the user: kept
    gen.generate("def f(x):", max_new_tokens=4)
    assert gen.num_speculative_tokens == 7

    given = SpeculativeGenerator(gen.target, gen.tokenizer, gen.drafter, num_speculative_tokens=3)
    given.generate("def f(x):", max_new_tokens=4)
    assert given.num_speculative_tokens == 3
    called = SpeculativeGenerator.from_pretrained(tiny_family["target"], tiny_family["unrelated"])
    out = called.generate("def f(x):", max_new_tokens=4, num_speculative_tokens=2)
    assert called.num_speculative_tokens == 4 and out.stats.drafted_tokens <= 2 * out.stats.target_forward_passes


# --- reported figures (issue 8, point 4) -----------------------------------------------------


def test_a_stop_string_leaves_complete_stats(tiny_family):
    """A stream ended by a stop string used to leave decode_seconds at 0 (0.0 tok/s)."""
    gen = SpeculativeGenerator.from_pretrained(tiny_family["target"], tiny_family["copy"])
    full = gen.generate("def add(a, b):", max_new_tokens=60, num_speculative_tokens=2).text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    stream = gen.stream("def add(a, b):", max_new_tokens=60, num_speculative_tokens=2, stop=stop)
    text = "".join(c.text for c in stream)
    assert text == full[: full.index(stop)]
    stats = stream.stats
    assert stats.finish_reason == "stop" and stats.decode_seconds > 0 and stats.decode_tokens >= 2
    assert stats.tokens_per_second > 0
    assert stats.to_dict()["tokens_per_second"] == pytest.approx(stats.tokens_per_second)
    assert "tok/s" in stats.summary()


def test_figures_that_mean_nothing_are_not_reported():
    one = GenerationStats(new_tokens=1, target_forward_passes=1, prefill_tokens=1, decode_seconds=1e-5,
                          prefill_seconds=0.01)
    assert one.to_dict()["tokens_per_second"] is None and "tok/s" not in one.summary()
    plain = GenerationStats(new_tokens=20, target_forward_passes=20, prefill_tokens=1, decode_seconds=0.1)
    assert plain.to_dict()["acceptance_rate"] is None
    assert "acceptance" not in plain.summary() and "mean accepted" not in plain.summary()
    assert plain.to_dict()["tokens_per_second"] == pytest.approx(200.0)
    assert "200.0 tok/s" in plain.summary()
    spec = GenerationStats(new_tokens=20, target_forward_passes=6, prefill_tokens=4, decode_seconds=0.1,
                           drafted_tokens=20, accepted_tokens=14)
    assert "acceptance 70% (14/20)" in spec.summary() and spec.to_dict()["acceptance_rate"] == 0.7


def test_every_name_the_readme_uses_comes_from_the_package():
    """The README's Python (``from quickdraft import ...`` and inline code such as
    ``options=DraftOptions(tree="2,2,1")``) works as written: `from quickdraft import
    DraftOptions` used to fail."""
    import re
    from pathlib import Path

    import quickdraft

    root = Path(__file__).resolve().parents[1]
    names = set()
    for doc in [root / "README.md", *(root / "docs").glob("*.md")]:
        text = doc.read_text()
        for group in re.findall(r"^\s*from quickdraft import ([\w, ]+)$", text, re.M):
            names |= {n.strip() for n in group.split(",")}
        if doc.name == "README.md":  # the guide to the public API (docs/ also cite internal classes)
            for span in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S)):
                names |= set(re.findall(r"\b([A-Z][a-z]+[A-Z][A-Za-z]*)[.(]", span))
    assert {"DraftOptions", "SamplingParams", "SpeculativeGenerator"} <= names
    missing = sorted(n for n in names if n not in quickdraft.__all__ or not hasattr(quickdraft, n))
    assert missing == []


def test_resolve_k_is_the_one_place_k_is_settled():
    """The CLI and the server both ask ``resolve_k``; a generator built directly (as the
    server builds it) gets the same k for a method as ``from_pretrained`` gives."""
    from quickdraft.drafters import DraftOptions, make_drafter
    from quickdraft.drafters.draft_stop import ADAPTIVE_MAX_DEPTH
    from quickdraft.drafters.layer_skip import load_profile

    plain = SpeculativeGenerator.from_pretrained(method="ar")
    assert plain.resolve_k(5) == (None, None)  # nothing drafts, so there is no k
    ngram = SpeculativeGenerator.from_pretrained(method="ngram")
    assert ngram.resolve_k(3) == (3, "given") and ngram.num_speculative_tokens == 3
    assert ngram.resolve_k() == (3, "default")

    skip = SpeculativeGenerator.from_pretrained(method="layer-skip")
    profile_k = load_profile(skip.target, None).k
    assert skip.num_speculative_tokens == profile_k
    direct = SpeculativeGenerator(skip.target, skip.tokenizer,
                                  make_drafter("layer-skip", None, skip.target.vocab_size, target=skip.target))
    assert direct.resolve_k() == (profile_k, "skip profile")

    adaptive = SpeculativeGenerator.from_pretrained(method="draft", options=DraftOptions(draft_stop="dv"))
    assert adaptive.num_speculative_tokens == ADAPTIVE_MAX_DEPTH
    assert adaptive.resolve_k() == (ADAPTIVE_MAX_DEPTH, "the most an adaptive --draft-stop drafts")


def test_options_none_means_the_defaults(tiny_family):
    """``options=None`` (Python's usual "not given") builds the method's defaults, through
    both constructors, instead of failing on an attribute of None."""
    from quickdraft.generator import DraftOptions

    given = SpeculativeGenerator.from_pretrained(tiny_family["target"], tiny_family["perturbed"], options=None)
    default = SpeculativeGenerator.from_pretrained(tiny_family["target"], tiny_family["perturbed"])
    assert given.num_speculative_tokens == default.num_speculative_tokens
    assert given.generate("def f(x):", max_new_tokens=8).token_ids == default.generate("def f(x):", max_new_tokens=8).token_ids
    pair = SpeculativeGenerator.for_pair(default.target, default.draft, default.tokenizer, "ngram", None)
    assert pair.plan.options == DraftOptions()
