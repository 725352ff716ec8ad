"""Batched generation from Python (generate([...])) and the CLI (--prompts-file)."""

import json
import subprocess
import sys

import pytest

from quickdraft.cli import main
from quickdraft.generator import SpeculativeGenerator


@pytest.fixture(scope="module")
def gen(tiny_family):
    return SpeculativeGenerator.from_pretrained(tiny_family["target"], tiny_family["perturbed"])


def test_generate_list_returns_one_result_per_prompt_equal_to_single_runs(gen):
    prompts = ["def add(a, b):", "for i in range(10):\n    print(i)\n" * 3, "x", "class Point:"]
    outs = gen.generate(prompts, max_new_tokens=16, num_speculative_tokens=3, batch_size=3)
    assert len(outs) == len(prompts)
    for prompt, out in zip(prompts, outs):
        single = gen.generate(prompt, max_new_tokens=16, num_speculative_tokens=3)
        assert out.token_ids == single.token_ids and out.text == single.text
        assert out.stats.finish_reason in ("length", "stop") and out.stats.new_tokens == len(out.token_ids)
    sampled = gen.generate(prompts[:2], max_new_tokens=12, temperature=0.8, seed=3, num_speculative_tokens=3)
    for prompt, out in zip(prompts[:2], sampled):
        assert out.token_ids == gen.generate(prompt, max_new_tokens=12, temperature=0.8, seed=3,
                                             num_speculative_tokens=3).token_ids
    with pytest.raises(ValueError, match="does not batch"):
        SpeculativeGenerator(gen.target, gen.tokenizer, _tree_drafter(gen)).generate(["a", "b"])


def _tree_drafter(gen):
    from quickdraft.drafters import DraftModelDrafter
    from quickdraft.drafters.shapes import StaticTree

    return DraftModelDrafter(gen.drafter.model, gen.target.vocab_size, StaticTree((2, 1)))


def test_prompts_file_prints_one_json_line_per_prompt(tiny_family, tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "def add(a, b):", "id": "a"}, {"prompt": "x", "max_new_tokens": 5},
             {"prompt": "class Point:", "temperature": 0.7, "seed": 4, "stop": ["\n\n"]}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    common = ["generate", "--model", str(tiny_family["target"]), "--draft", str(tiny_family["perturbed"]),
              "--max-new-tokens", "12", "-k", "3"]
    assert main([*common, "--prompts-file", str(path), "--batch-size", "2"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2] and rows[0]["id"] == "a"
    assert len(rows[1]["token_ids"]) <= 5 and rows[2]["settings"]["seed"] == 4
    for line, row in zip(lines[:2], rows[:2]):  # greedy rows: what generate --method ar prints
        budget = str(line.get("max_new_tokens", 12))
        assert main(["generate", "--model", str(tiny_family["target"]), "--method", "ar", "--json",
                     "--prompt", line["prompt"], "--max-new-tokens", budget]) == 0
        single = json.loads(capsys.readouterr().out)
        assert row["token_ids"] == single["token_ids"] and row["text"] == single["text"]


@pytest.mark.parametrize("content,message", [
    (None, "does not exist"),
    ('{"prompt": "a"}\nnot json\n', "line 2 is not JSON"),
    ('{"text": "a"}\n', "unknown key 'text'"),
    ('{"prompt": 3}\n', "needs a non-empty \"prompt\""),
    ('{"prompt": "a", "top_p": 2}\n', "\"top_p\" must be a number in (0, 1]"),
    ('{"prompt": "a", "max_new_tokens": 0}\n', "\"max_new_tokens\" must be an integer >= 1"),
    ("\n", "has no prompts"),
])
def test_bad_prompts_file_is_one_line_and_exit_2(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    if content is not None:
        path.write_text(content)
    proc = subprocess.run([sys.executable, "-m", "quickdraft.cli", "generate", "--prompts-file", str(path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and message in proc.stderr and "Traceback" not in proc.stderr


def test_batched_rows_follow_the_heuristic_draft_stop_each_its_own(tiny_family, tmp_path, capsys):
    """``--draft-stop heuristic`` with batched rows: each row's chain follows its own
    acceptance (shorter after a rejection), output unchanged; a policy that ends chains
    token by token is a one-line error (a batched drafter drafts every row's chain at once)."""
    from quickdraft.drafters import DraftOptions

    prompts = ["def add(a, b):", "for i in range(10):\n    print(i)\n" * 3, "x", "class Point:"]
    runs = {}
    for stop in ("fixed", "heuristic"):
        gen = SpeculativeGenerator.from_pretrained(tiny_family["target"], tiny_family["perturbed"],
                                                   options=DraftOptions(draft_stop=stop))
        runs[stop] = gen.generate(prompts, max_new_tokens=24, num_speculative_tokens=6, batch_size=3)
    assert [o.token_ids for o in runs["heuristic"]] == [o.token_ids for o in runs["fixed"]]
    drafted = {stop: [o.stats.drafted_tokens / o.stats.target_forward_passes for o in outs]
               for stop, outs in runs.items()}
    assert all(h <= f for h, f in zip(drafted["heuristic"], drafted["fixed"]))
    assert sum(drafted["heuristic"]) < sum(drafted["fixed"])  # rejections shortened some rows' chains
    dv = SpeculativeGenerator.from_pretrained(tiny_family["target"], tiny_family["perturbed"],
                                              options=DraftOptions(draft_stop="dv"))
    with pytest.raises(ValueError, match="token by token.*heuristic"):
        dv.generate(prompts[:2], max_new_tokens=4)
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "x"}\n{"prompt": "def f():"}\n')
    assert main(["generate", "--model", str(tiny_family["target"]), "--draft", str(tiny_family["perturbed"]),
                 "--prompts-file", str(path), "--draft-stop", "dv"]) != 0
    assert "--draft-stop dv ends a chain token by token" in capsys.readouterr().err


def test_the_server_batches_heuristic_chains_and_serves_token_by_token_policies_solo(gen):
    from quickdraft.cli import CliError
    from quickdraft.drafters import DraftOptions
    from quickdraft.server.cli import make_engine

    draft = gen.drafter.model
    engine = make_engine("batch", gen.target, "draft", draft, 2, 3, True, DraftOptions(draft_stop="heuristic"), "mss")
    assert engine.name == "batch" and engine.draft_stop().name == "heuristic"
    assert make_engine("auto", gen.target, "draft", draft, 2, 3, True, DraftOptions(draft_stop="dv"), "mss").name == "solo"
    with pytest.raises(CliError, match="token by token"):
        make_engine("batch", gen.target, "draft", draft, 2, 3, True, DraftOptions(draft_stop="dv"), "mss")
