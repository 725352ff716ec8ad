"""quickdraft train data: the target writes its own training data in resumable shards, and
quickdraft train draft trains on those token ids (issue #24 point 4)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from quickdraft import cli
from quickdraft.train import shards
from quickdraft.train.instructions import catalogue, instruction
from quickdraft.train.selfdistill import MIX, DataSettings, JobPlan

TARGET = "qd-stdlib-target"  # the embedded target: it has a chat template


@pytest.fixture(autouse=True)
def user_config(tmp_path, monkeypatch):
    monkeypatch.setenv("QUICKDRAFT_CONFIG_DIR", str(tmp_path / "config"))


def make_data(out, tokens: int, *extra: str) -> int:
    return cli.main(["train", "data", "--target", TARGET, "--out", str(out), "--tokens", str(tokens),
                     "--shard-jobs", "5", "--batch-size", "5", "--max-new-tokens", "12", "--no-progress",
                     *extra])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Two shards (greedy), the second made by a second run that continued the first."""
    out = tmp_path_factory.mktemp("selfdistill") / "data"
    assert make_data(out, 1, "--temperature", "0") == 0
    assert shards.done_shards(out) == [0]
    assert make_data(out, 2 * 5 * 12 - 20, "--temperature", "0") == 0  # more than one shard holds
    return out


def test_shards_hold_the_targets_own_greedy_tokens(data):
    from quickdraft.generator import SpeculativeGenerator

    assert shards.done_shards(data) == [0, 1]
    assert not list(data.glob("*.tmp"))
    docs = shards.read_shard(data, 0) + shards.read_shard(data, 1)
    kinds = {rec["kind"] for rec, _ in docs}
    assert kinds == {"chat", "self-instruct-question", "self-instruct", "code"}
    plain = SpeculativeGenerator.from_pretrained(TARGET, method="ar")
    plan = JobPlan(DataSettings(target=TARGET, temperature=0))
    checked = 0
    for rec, ids in docs:
        assert ids.size == rec["prompt_tokens"] + rec["new_tokens"] and rec["new_tokens"] > 0
        if rec["kind"] == "chat":  # a built-in instruction through the chat template, then the answer
            prompt = plain.chat_ids([{"role": "user", "content": plan.instruction(rec["job"])}])
            assert ids[: len(prompt)].tolist() == prompt
            out = plain.generate(prompt, max_new_tokens=12)
            assert ids[len(prompt):].tolist() == out.token_ids and rec["text"] == out.text
            checked += 1
        if rec["kind"] == "code":
            assert rec["source"].startswith("stdlib:")
    assert checked >= 2


def test_jobs_are_a_fixed_mix_and_reruns_with_other_settings_refuse(data, capsys):
    plan = JobPlan(DataSettings(target=TARGET, temperature=0))
    assert [plan.kind(j) for j in range(10)] == ["chat"] * 4 + ["self-instruct"] * 2 + ["code"] * 4
    meta = json.loads((data / shards.META_FILE).read_text())
    assert meta["temperature"] == 0 and meta["shard_jobs"] == 5 and meta["instructions"] == "catalogue"
    assert meta["mix"] == dict(MIX)
    capsys.readouterr()
    assert make_data(data, 10_000, "--temperature", "0.8") == 2  # other settings: one line, exit 2
    err = capsys.readouterr().err.strip()
    assert "other settings" in err and "\n" not in err
    assert shards.done_shards(data) == [0, 1]
    assert make_data(data, 1, "--temperature", "0") == 0  # enough already: nothing to do
    assert "nothing to do" in capsys.readouterr().err


def test_train_draft_reads_the_shards_as_token_ids(data, tmp_path):
    from quickdraft.models.loading import resolve_model_dir
    from quickdraft.pair import load_tokenizer
    from quickdraft.train.distill import tokenize
    from quickdraft.train.textdata import read_text_data

    text = read_text_data([str(data)])
    docs = shards.read_documents(data)
    assert len(text.train_ids) + len(text.heldout_ids) == len(docs) and text.heldout_ids
    tok = load_tokenizer(resolve_model_dir(TARGET))
    tokens = tokenize(text, tok, 16)
    stored = sum(ids.size for _, ids, _ in docs)
    assert tokens.train.size + tokens.heldout.size == stored + len(docs)  # one EOS before each
    first = dict(text.train_ids)[text.train_ids[0][0]]
    assert np.array_equal(tokens.train[1 : 1 + first.size], first)
    out = tmp_path / "draft"
    assert cli.main(["train", "draft", "--target", TARGET, "--out", str(out), "--data", str(data),
                     "--config", "tiny", "--steps", "2", "--seq-len", "32", "--batch-size", "2",
                     "--kl-weight", "0", "--draft-vocab", "64", "--eval-tokens", "64", "--probe-every", "0",
                     "--threads", "1", "--no-progress", "--loss-on", "all"]) == 0  # (few answers in 2 x 2 windows)
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    train = [r for r in log if r["event"] == "train"]
    assert json.loads((out / "draft_vocab.json").read_text())["size"] == 64
    assert train and all("kl" not in r and 0 < r["in_vocab"] <= 1 for r in train)  # hard labels, draft vocab


def test_bad_input_is_one_line(tmp_path, capsys):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "a.txt").write_text("x")
    assert make_data(tmp_path / "junk", 10) == 2
    err = capsys.readouterr().err.strip()
    assert "not empty" in err and "\n" not in err
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / shards.META_FILE).write_text(json.dumps({"format": shards.FORMAT}))
    assert cli.main(["train", "draft", "--target", TARGET, "--out", str(tmp_path / "d"), "--data", str(empty),
                     "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no complete shard" in err and "\n" not in err


def test_a_draft_from_the_target_is_its_embeddings_and_evenly_spaced_layers():
    from quickdraft.train.distill import load_teacher
    from quickdraft.train.draft import student_from_target, target_layers
    from quickdraft.train.presets import Arch
    from quickdraft.train.textdata import TrainInputError

    assert target_layers(30, 2) == [0, 29] and target_layers(8, 3) == [0, 4, 7] and target_layers(8, 1) == [0]
    teacher, _, _ = load_teacher(TARGET)
    width = teacher.config.hidden_size
    student = student_from_target(teacher, Arch(width, 2, teacher.config.num_attention_heads, 64), seed=0)
    cfg, target_cfg = student.config.to_dict(), teacher.config.to_dict()
    assert len(student.model.layers) == 2 and cfg.get("rope_parameters") == target_cfg.get("rope_parameters")
    for mine, theirs in zip(student.model.layers, (0, 7)):
        for (name, p), q in zip(mine.state_dict().items(), teacher.model.layers[theirs].state_dict().values()):
            assert torch.equal(p, q), name
    assert torch.equal(student.get_output_embeddings().weight, teacher.get_output_embeddings().weight)
    # the embedding is the target's own tensor, frozen (shared, not shipped); the rest trains
    assert student.model.embed_tokens.weight is teacher.model.embed_tokens.weight
    assert not student.model.embed_tokens.weight.requires_grad
    assert student.training and all(p.requires_grad for n, p in student.named_parameters() if "embed" not in n)
    with pytest.raises(TrainInputError, match="as wide as the target"):
        student_from_target(teacher, Arch(width // 2, 2, 4, 64), seed=0)


def test_greedy_chat_jobs_ask_every_instruction_once():
    """At temperature 0 an instruction always gets the same answer: a new directory's chat
    jobs walk the catalogue, each instruction once, and the chat jobs after it are
    self-instruct jobs; sampled, they go round again. The first plan (older directories)
    is kept: job j asks instruction(j), which repeats."""
    greedy = JobPlan(DataSettings(target=TARGET, temperature=0, mix=(("chat", 6), ("self-instruct", 3), ("code", 1))))
    jobs = range(4000)
    chats = [j for j in jobs if greedy.kind(j) == "chat"]
    asked = [greedy.instruction(j) for j in chats]
    assert sorted(asked) == sorted(catalogue()) and len(set(asked)) == len(asked)  # each once, none lost
    assert greedy.kind(10 * 320) == "self-instruct" and greedy.kind(10 * 320 + 9) == "code"  # past the end
    sampled = JobPlan(DataSettings(target=TARGET, temperature=0.8))
    again = [sampled.instruction(j) for j in range(2 * 5000) if sampled.kind(j) == "chat"]
    assert len(again) == 4000 and again[len(catalogue()):2 * len(catalogue())] == list(catalogue())
    old = JobPlan(DataSettings(target=TARGET, temperature=0, instructions="cycle"))
    assert [old.instruction(j) for j in range(30)] == [instruction(j) for j in range(30)]
    assert all(old.kind(j) == ("chat" if j % 10 < 4 else "self-instruct" if j % 10 < 6 else "code") for j in jobs)


def test_the_catalogue_is_frozen():
    """Directories resume by chat-job ordinal: a changed catalogue would ask a committed
    directory's later shards other questions. Add instructions as a new plan instead."""
    import hashlib

    text = "\n".join(catalogue())
    assert len(catalogue()) == 1908
    assert hashlib.sha256(text.encode()).hexdigest() == "ea675c604422cdc292d7884c1d3617f8bc0cf8872a5c1227921169b91b2bcaf9"


def test_no_built_in_instruction_is_a_bench_chat_prompt():
    """The bench's chat prompts are held out: the drafter must not be trained on them."""
    from quickdraft.bench.prompts import builtin_prompts

    bench = {p.prompt.strip().lower() for p in builtin_prompts(("chat",))}
    assert len(bench) == 8 and not bench & {t.strip().lower() for t in catalogue()}


def test_a_greedy_shard_past_the_catalogue_asks_no_instruction():
    from quickdraft.generator import SpeculativeGenerator
    from quickdraft.train.selfdistill import ShardMaker

    settings = DataSettings(target=TARGET, temperature=0, shard_jobs=10, max_new_tokens=4, question_tokens=4,
                            mix=(("chat", 7), ("self-instruct", 0), ("code", 3)))
    plan = JobPlan(settings)
    index = len(catalogue()) // 7  # the shard where the catalogue runs out
    assert len(catalogue()) % 7, "pick a chat count that the catalogue's size is no multiple of"
    gen = SpeculativeGenerator.from_pretrained(TARGET, method="ar")
    docs = ShardMaker(gen, settings, batch_size=10).make(index)
    kinds: dict[int, set[str]] = {}
    for _, rec in docs:
        kinds.setdefault(rec["job"], set()).add(rec["kind"])
    jobs = range(index * 10, index * 10 + 10)
    assert {plan.kind(j) for j in jobs} == {"chat", "self-instruct", "code"}
    assert all(("chat" in kinds[j]) == (plan.kind(j) == "chat") for j in jobs)
    assert all(("self-instruct-question" in kinds[j]) == (plan.kind(j) == "self-instruct") for j in jobs)


def test_mix_is_parsed_recorded_and_kept(tmp_path, capsys):
    out = tmp_path / "d"
    assert make_data(out, 1, "--temperature", "0", "--mix", "chat=3,code=2") == 0
    assert json.loads((out / shards.META_FILE).read_text())["mix"] == {"chat": 3, "self-instruct": 0, "code": 2}
    docs = shards.read_shard(out, 0)
    assert [rec["kind"] for rec, _ in docs] == ["chat"] * 3 + ["code"] * 2
    assert make_data(out, 10_000, "--temperature", "0", "--mix", "chat=4") == 2  # another mix: refused
    assert "other settings" in capsys.readouterr().err
    for bad in ("chat=x", "poems=3", "chat=1,chat=2", "chat=0"):
        assert make_data(tmp_path / "e", 1, "--mix", bad) == 2
        err = capsys.readouterr().err.strip()
        assert "--mix" in err and "\n" not in err
    assert not (tmp_path / "e").exists()


def test_data_records_its_precision_and_reads_older_shards_as_float32(data, tmp_path, capsys):
    import shutil

    assert json.loads((data / shards.META_FILE).read_text())["dtype"] == "float32"
    older = tmp_path / "older"
    shutil.copytree(data, older)
    meta = json.loads((older / shards.META_FILE).read_text())
    del meta["dtype"]  # written before the record had it: made on the CPU, in float32
    del meta["instructions"]  # likewise: such a directory keeps the first plan (cycle)
    (older / shards.META_FILE).write_text(json.dumps(meta))
    capsys.readouterr()
    assert make_data(older, 1, "--temperature", "0") == 0
    assert "nothing to do" in capsys.readouterr().err
    meta["fresh_instructions"] = True  # a greedy plan this version no longer writes: one line, exit 2
    (older / shards.META_FILE).write_text(json.dumps(meta))
    assert make_data(older, 1, "--temperature", "0") == 2
    err = capsys.readouterr().err.strip()
    assert "new --out" in err and "\n" not in err


def test_data_on_a_missing_device_is_one_line(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert make_data(tmp_path / "d", 10, "--device", "cuda") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cuda" in err.lower()
    assert not (tmp_path / "d").exists()


def test_answers_to_one_prompt_are_held_out_together(tmp_path):
    """The shard sets answer the same instructions many times: a held-out answer to a prompt
    that is also trained on scores memory, not prediction (session 49), so a shard document
    is held out by its prompt's ids, every answer to one prompt on the same side."""
    from quickdraft.train.textdata import read_text_data

    root = tmp_path / "shards"
    root.mkdir()
    (root / shards.META_FILE).write_text(json.dumps({"format": shards.FORMAT}))
    rng = np.random.default_rng(0)
    docs = []
    for prompt in range(200):
        for _ in range(3):  # three answers to each prompt
            ids = [prompt, 7, 7, 7] + rng.integers(0, 900, size=6).tolist()
            docs.append((ids, {"prompt_tokens": 4}))
    shards.write_shard(root, 0, docs, vocab_size=1000)
    data = read_text_data([str(root)])
    side = {}
    for held, split in ((True, data.heldout_ids), (False, data.train_ids)):
        for _, ids in split:
            assert side.setdefault(int(ids[0]), held) == held, f"prompt {ids[0]} on both sides"
    assert 0 < sum(side.values()) < len(side)
