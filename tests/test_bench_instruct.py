"""The bench's instruct categories (chat through the model's template, code completion) and
transformers' baselines on them: every row gets the same token ids, stops at the
template's end-of-turn, and transformers' greedy output is checked against ours."""

from __future__ import annotations

import json

import pytest

from quickdraft.bench.cli import default_categories
from quickdraft.bench.config import BenchConfig, BenchError
from quickdraft.bench.context import load_context
from quickdraft.bench.prompts import (
    CATEGORIES,
    INSTRUCT_CATEGORIES,
    PromptFileError,
    builtin_prompts,
    load_prompts,
    select,
)
from quickdraft.bench.runner import run_benchmark
from quickdraft.chat import chat_prompt_ids, end_of_turn_ids


def test_instruct_categories_are_stored_and_default_for_packaged_models():
    prompts = builtin_prompts(INSTRUCT_CATEGORIES)
    chat = [p for p in prompts if p.category == "chat"]
    code = [p for p in prompts if p.category == "code"]
    assert len(chat) >= 8 and len(code) >= 8
    assert all(p.is_chat and p.messages[-1] == {"role": "user", "content": p.prompt} for p in chat)
    assert all(p.origin and "written for quickdraft" in p.origin["source"] for p in chat)
    assert not any(p.is_chat for p in code) and {p.kind for p in code} == {"function-body", "docstring"}
    # code is cut from the stored sets, so it shares their sources (never trained on).
    others = {p.source for p in builtin_prompts(("short", "out-of-domain"))}
    assert {p.source for p in code} <= others
    assert default_categories("smollm2-135m") == INSTRUCT_CATEGORIES
    assert default_categories(None) == CATEGORIES == default_categories("qd-stdlib-target")


def test_bad_messages_in_a_prompt_file_are_one_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "x", "messages": [{"role": "robot", "content": "x"}]}) + "\n")
    with pytest.raises(PromptFileError, match="p.jsonl:1: 'messages': message 0 has role 'robot'"):
        load_prompts(path)


@pytest.mark.slow  # 10-20 s: sorted first (conftest.py), never a worker's last test
def test_chat_and_code_rows_share_ids_stop_at_end_of_turn_and_agree(tmp_path):
    """On the embedded pair (its tokenizer has a chat template): our rows and transformers'
    (plain, assisted with the same draft, prompt lookup) on a chat and a code prompt."""
    prompts = select(builtin_prompts(INSTRUCT_CATEGORIES), None, 1)
    config = BenchConfig(methods=("ar", "ngram", "hf-ar", "hf-assisted", "hf-lookup"), max_new_tokens=12,
                         repeats=1, k=3, sweep=(), warmup_tokens=4)
    ctx = load_context(config)
    plain_eos = list(ctx.eos_token_ids)
    result = run_benchmark(ctx, prompts, config)
    assert set(end_of_turn_ids(ctx.tokenizer)) <= set(ctx.eos_token_ids) and ctx.eos_token_ids[:len(plain_eos)] == plain_eos
    groups = {g["category"]: g for g in result["results"]}
    assert list(groups) == ["chat", "code"]
    chat = prompts[0]
    assert groups["chat"]["prompt_tokens"] == [len(chat_prompt_ids(ctx.tokenizer, chat.messages))]
    assert groups["code"]["prompt_tokens"] == [len(ctx.tokenizer(prompts[1].prompt)["input_ids"])]
    labels = {r["label"]: r for r in result["overall"]["rows"]}
    assert set(labels) == {"ar", "ngram k=3,ngram_max=3", "hf-ar", "hf-assisted k=3", "hf-lookup k=3,ngram_max=3"}
    for label, row in labels.items():
        assert row["lossless"] is True, label  # transformers' greedy tokens == ours
    assert not result["mismatches"]


def test_chat_prompts_need_a_template(tmp_path):
    import shutil

    from quickdraft.models.registry import ASSETS_DIR

    bare = tmp_path / "bare"
    shutil.copytree(ASSETS_DIR / "qd-stdlib-target", bare, ignore=shutil.ignore_patterns("chat_template.jinja", "*.png"))
    config = BenchConfig(model=str(bare), methods=("ar",), max_new_tokens=4, repeats=1, sweep=())
    with pytest.raises(BenchError, match="chat prompt chat-code-1: model bare has no chat template"):
        run_benchmark(load_context(config), select(builtin_prompts(("chat",)), None, 1), config)


def test_the_auto_row_decodes_chat_prompts_with_the_choice_for_chats():
    """Auto's row runs each prompt as users get it: a chat prompt (an id in
    ``ctx.chat_prompts``, warm-up included) with the choice measured on chats, others with
    the choice for completions (here: plain decoding and the draft, real rows both)."""
    from quickdraft.bench.methods import EngineMethod
    from quickdraft.bench.registry import AutoMethod
    from quickdraft.decoding.sampling import SamplingParams
    from quickdraft.drafters import DraftModelDrafter

    ctx = load_context(BenchConfig(methods=("ar", "draft"), sweep=()))
    ctx.chat_prompts = {"chat-1"}
    completion = EngineMethod("auto", None, None, settings={"chose": "ar"})
    chat = EngineMethod("auto", lambda c: DraftModelDrafter(c.draft, c.target.vocab_size), 4,
                        settings={"chose": "draft k=4"})
    row = AutoMethod(completion, chat)
    assert row.settings == {"chose": "ar", "chats": "draft k=4"} and row.k == 4 and row.speculative
    ids = ctx.tokenizer("def add(a, b):", return_tensors="pt")["input_ids"][0]
    runs = {key: row.run(ctx, ids, 12, SamplingParams(), key) for key in ("chat-1", "warm-up:chat-1", "code-1")}
    assert runs["chat-1"].stats.drafted_tokens > 0 and runs["warm-up:chat-1"].stats.drafted_tokens > 0
    assert runs["code-1"].stats.drafted_tokens == 0
    assert runs["chat-1"].tokens == runs["code-1"].tokens  # lossless either way
    assert AutoMethod(completion, None).settings == {"chose": "ar"}
