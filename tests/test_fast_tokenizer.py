"""Our tokenizer.json tokenizer (quickdraft.models.tokenizer) against transformers' AutoTokenizer,
the reference: same backend state, ids, text, special tokens and chat prompts; and start-up
that never imports transformers on the native path."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
from conftest import build_tokenizer
from smollm2 import FILE as SMOLLM2_FILE
from smollm2 import NEEDS_SMOLLM2
from transformers import AutoTokenizer

from quickdraft.models import gguf
from quickdraft.models.registry import ASSETS_DIR
from quickdraft.models.tokenizer import FastTokenizer, load_fast_tokenizer
from quickdraft.pair import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
TEXTS = [
    "", " ", "  \t\n\n   x  ", "def f(x):\n    return x ** 2  # square\n", "\tif a != b:\r\n\t\tpass",
    "héllo wörld — ünïcode ✓ 你好 🙂🙂", "\u00a0\u200b\ufeffzero width", "<|endoftext|>",
    "a<|endoftext|>b <|endoftext|> c", "<|im_start|>user\nhi<|im_end|>\n", "<|pad|> <|im_start|>",
    "x" * 300, "1234567890 3.14159e-10", "    " * 10 + "return",
]
MESSAGES = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo ✓\n  def f():"},
     {"role": "assistant", "content": "ok", "name": None}, {"role": "user", "content": ""}],
]
#: Exercises the environment: namespace, loop controls, a generation block, tojson (no
#: HTML escaping), dict, trim/lstrip of blocks, variables, reasoning aliases.
TEMPLATE = """{%- set ns = namespace(n=0) -%}
{% for m in messages %}
  {% if m.role == 'system' %}{% continue %}{% endif %}
  {% set ns.n = ns.n + 1 %}
<{{ m.role }} {{ ns.n }}>{% generation %}{{ m.content | trim }}{% endgeneration %}
{{ {'len': m.content | length, 'raw': m.content, 'html': '<&>'} | tojson }}
  {% if m.thinking is defined %}[{{ m.thinking }}|{{ m.reasoning_content }}]{% endif %}
{% endfor %}
{{ dict(a=1, b=[2]) | tojson(indent=1) }}{{ eos_token }}{{ bos_token }}{{ extra | default('-') }}
{%- if tools %}{{ tools | tojson }}{% endif %}
{%- if add_generation_prompt %}<assistant>{% endif -%}"""


def _legacy_tokenizer(path: Path) -> Path:
    """Our tiny tokenizer with the older files and settings: special_tokens_map.json adding
    tokens the vocabulary lacks, AddedToken dicts, named templates in the config."""
    build_tokenizer(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["eos_token"] = {"__type": "AddedToken", "content": "<|endoftext|>", "lstrip": False, "rstrip": False,
                           "normalized": False, "single_word": False, "special": True}
    config["chat_template"] = [{"name": "default", "template": "{% for m in messages %}{{ m.content }};{% endfor %}"},
                               {"name": "tool_use", "template": "{{ tools | tojson }}{{ messages[0].content }}"}]
    config["model_max_length"] = 1024
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    (path / "special_tokens_map.json").write_text(json.dumps({
        "pad_token": {"content": "<|pad|>", "lstrip": True, "rstrip": False, "normalized": False, "single_word": False},
        "unk_token": "<|im_start|>",
    }))
    return path


def _added_decoder_tokenizer(path: Path) -> Path:
    """The config's added_tokens_decoder (a new non-special token) and split_special_tokens."""
    build_tokenizer(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    vocab = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
    decoder = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in vocab}
    decoder["300"] = {"content": "<|pad|>", "lstrip": False, "rstrip": True, "normalized": False,
                      "single_word": False, "special": False}
    config.update(added_tokens_decoder=decoder, split_special_tokens=True, pad_token="<|pad|>")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fast_tok")
    dirs = {"embedded": ASSETS_DIR / "qd-stdlib-target", "smollm2-draft": ASSETS_DIR / "qd-smollm2-135m-draft"}
    build_tokenizer(root / "tiny")
    dirs["tiny"] = root / "tiny"
    dirs["legacy"] = _legacy_tokenizer(root / "legacy")
    dirs["added"] = _added_decoder_tokenizer(root / "added")
    return dirs


@pytest.mark.parametrize("name", ["embedded", "smollm2-draft", "tiny", "legacy", "added"])
def test_fast_tokenizer_equals_transformers(tokenizer_dirs, name):
    model_dir = tokenizer_dirs[name]
    ours, ref = load_fast_tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    assert isinstance(ours, FastTokenizer)
    _assert_same(ours, ref)


@NEEDS_SMOLLM2[0]
@NEEDS_SMOLLM2[1]
def test_smollm2_gguf_tokenizer_equals_transformers():
    gguf.load_tokenizer(SMOLLM2_FILE)  # builds the cache entry where it is missing
    ours = gguf.load_tokenizer(SMOLLM2_FILE)
    assert isinstance(ours, FastTokenizer)
    _assert_same(ours, AutoTokenizer.from_pretrained(ours.name_or_path))


def _assert_same(ours, ref) -> None:
    assert ours.backend_tokenizer.to_str() == ref.backend_tokenizer.to_str()
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id", "pad_token_id",
                 "unk_token_id", "all_special_tokens", "all_special_ids", "special_tokens_map", "vocab_size",
                 "model_max_length", "chat_template", "clean_up_tokenization_spaces", "extra_special_tokens"):
        assert getattr(ours, attr) == getattr(ref, attr), attr
    assert len(ours) == len(ref) and ours.get_vocab() == ref.get_vocab()
    assert {i: (str(t), t.special) for i, t in ours.added_tokens_decoder.items()} == \
        {i: (str(t), t.special) for i, t in ref.added_tokens_decoder.items()}
    for text in TEXTS:
        for special in (True, False):
            assert ours(text, add_special_tokens=special, verbose=False) == dict(ref(text, add_special_tokens=special))
            ids = ref(text, add_special_tokens=special)["input_ids"]
            assert ours.encode(text, add_special_tokens=special) == ids
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
            assert ours.convert_ids_to_tokens(ids, skip_special_tokens=special) == \
                ref.convert_ids_to_tokens(ids, skip_special_tokens=special)
    assert dict(ours(TEXTS)) == dict(ref(TEXTS))
    some = list(range(0, len(ref), max(1, len(ref) // 97))) + [len(ref) - 1]  # byte pieces, half characters
    for n in range(1, 6):
        assert ours.decode(some[n::7], clean_up_tokenization_spaces=True) == \
            ref.decode(some[n::7], clean_up_tokenization_spaces=True)
    assert ours.convert_tokens_to_ids(["<|endoftext|>", "no such token"]) == \
        ref.convert_tokens_to_ids(["<|endoftext|>", "no such token"])
    if ref.chat_template:
        tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        for messages in MESSAGES:
            for prompt in (True, False):
                assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt) == \
                    ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert ours.apply_chat_template(messages, tools=tools, tokenize=False) == \
                ref.apply_chat_template(messages, tools=tools, tokenize=False)


def test_chat_template_environment_matches_transformers(tokenizer_dirs):
    model_dir = tokenizer_dirs["tiny"]
    ours, ref = load_fast_tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "  a <b> & \"c\"  "},
                {"role": "assistant", "content": "d", "reasoning": "because"}]
    tools = [{"name": "f", "description": "é"}]
    for kwargs in ({}, {"add_generation_prompt": True, "extra": "X"}, {"tools": tools}):
        rendered = ours.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False, **kwargs)
        assert rendered == ref.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False, **kwargs)
    assert '"<&>"' in rendered and "[because|because]" in rendered  # no HTML escaping; reasoning aliased
    refusing = "{{ raise_exception('no system messages') }}"
    with pytest.raises(jinja2.TemplateError, match="no system messages"):
        ours.apply_chat_template(messages, chat_template=refusing, tokenize=False)
    with pytest.raises(jinja2.exceptions.SecurityError):
        ours.apply_chat_template(messages, chat_template="{% set ns = namespace(_x=1) %}", tokenize=False)
    with pytest.raises(jinja2.exceptions.SecurityError):  # the sandbox: no reaching Python internals
        ours.apply_chat_template(messages, chat_template="{{ messages.__class__.__mro__ }}", tokenize=False)


def test_what_we_do_not_answer_goes_to_transformers(tokenizer_dirs):
    model_dir = tokenizer_dirs["tiny"]
    ours, ref = load_fast_tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    assert ours("def f", return_tensors="pt").input_ids.tolist() == ref("def f", return_tensors="pt").input_ids.tolist()
    assert ours.apply_chat_template(MESSAGES[1], chat_template=TEMPLATE, add_generation_prompt=True)["input_ids"] == \
        ref.apply_chat_template(MESSAGES[1], chat_template=TEMPLATE, add_generation_prompt=True)["input_ids"]
    assert ours.padding_side == ref.padding_side  # not ours: transformers' attribute
    ours.model_max_length = 77
    ours.save_pretrained(model_dir.parent / "saved")
    assert AutoTokenizer.from_pretrained(str(model_dir.parent / "saved")).model_max_length == 77


def test_other_tokenizer_classes_stay_with_transformers(tokenizer_dirs, tmp_path):
    AutoTokenizer.from_pretrained(str(tokenizer_dirs["tiny"])).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    assert load_fast_tokenizer(tmp_path) is None
    assert not isinstance(load_tokenizer(tmp_path), FastTokenizer)
    assert isinstance(load_tokenizer(tokenizer_dirs["tiny"]), FastTokenizer)


def test_a_broken_tokenizer_file_is_one_line(tokenizer_dirs, tmp_path):
    from quickdraft.models.loading import CheckpointError

    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((tokenizer_dirs["tiny"] / name).read_text()[:50])
    with pytest.raises(CheckpointError, match=r"the tokenizer in .* could not be loaded"):
        load_tokenizer(tmp_path)


def _run(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_generate_never_imports_transformers():
    """The start-up goal: the embedded pair generates (tokenizer, chat template, model,
    detokenizing) without importing transformers, which costs 1-2 s."""
    out = _run(
        "import sys\n"
        "from quickdraft.cli import main\n"
        "code = main(['generate', '--prompt', 'def f', '--max-new-tokens', '4', '--method', 'draft', '-k', '2'])\n"
        "code += main(['generate', '--chat', 'import os', '--max-new-tokens', '2', '--method', 'ar'])\n"
        "assert code == 0, code\n"
        "print('transformers' in sys.modules)\n")
    assert out.strip().splitlines()[-1] == "False"


def test_quiet_transformers_quiets_an_import_inside_it():
    """Not imported on entry: transformers is quieted as it is imported inside the block,
    and its settings are restored on exit."""
    out = _run(
        "import sys\n"
        "from quickdraft.quiet import quiet_transformers\n"
        "assert 'transformers' not in sys.modules\n"
        "with quiet_transformers():\n"
        "    from transformers.utils import logging\n"
        "    from huggingface_hub.utils import are_progress_bars_disabled\n"
        "    inside = (logging.get_verbosity(), logging.is_progress_bar_enabled(), are_progress_bars_disabled())\n"
        "print(inside, (logging.get_verbosity(), logging.is_progress_bar_enabled(), are_progress_bars_disabled()))\n")
    assert out.strip() == "(40, False, True) (30, True, False)"  # ERROR inside, WARNING (the default) after
