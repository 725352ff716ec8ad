"""Chat: messages through the model's own chat template, the reply ending at the template's
end-of-turn token, for the Python API, the CLI and the server; a model without a template
is refused, not prompted in a made-up format.

The ChatML model is the embedded target given ChatML's special tokens: its tokenizer gets
``<|im_start|>`` and ``<|im_end|>`` and a ChatML template, its embedding two rows, and its
LM head scores ``<|im_end|>`` above a token it would otherwise write early in its reply, so
greedy decoding really does end its turn there.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from quickdraft import SpeculativeGenerator
from quickdraft.chat import NoChatTemplateError, end_of_turn_ids, render_chat
from quickdraft.cli import main
from quickdraft.models.registry import ASSETS_DIR
from quickdraft.train.tokenizer import CODE_CHAT_TEMPLATE_FILE

EMBEDDED = ASSETS_DIR / "qd-stdlib-target"
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def median(values):"}]
BUDGET = 16


def chatml_tokenizer(source: Path = EMBEDDED):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(source))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    return tok


def save_model(out: Path, embed: torch.Tensor, lm_head: torch.Tensor, tok) -> Path:
    """The embedded target with these embedding and (untied) LM head matrices."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    state = load_file(str(EMBEDDED / "model.safetensors"))
    state["model.embed_tokens.weight"], state["lm_head.weight"] = embed, lm_head
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((EMBEDDED / "config.json").read_text())
    config.update(vocab_size=embed.shape[0], tie_word_embeddings=False)
    (out / "config.json").write_text(json.dumps(config))
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def chatml(tmp_path_factory) -> Path:
    """A directory with the ChatML model (see the module's docstring)."""
    from safetensors.torch import load_file

    tok = chatml_tokenizer()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    embed = load_file(str(EMBEDDED / "model.safetensors"))["model.embed_tokens.weight"].float()
    newline = tok("\n")["input_ids"][0]
    embed = torch.cat([embed, embed[newline].repeat(2, 1)])  # the new tokens read as line breaks
    head = embed.clone()
    head[-2:] = 0.0  # ...and are not predicted (checked below)
    work = tmp_path_factory.mktemp("chatml")
    first = save_model(work / "first", embed, head, tok)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    reply = SpeculativeGenerator.from_pretrained(first, method="ar").generate(ids, max_new_tokens=BUDGET).token_ids
    assert not set(reply) & {im_end, im_end - 1}
    # A token first written halfway through the reply: <|im_end|> takes its place (or comes sooner).
    token = next(t for i, t in enumerate(reply) if i >= BUDGET // 2 and reply.index(t) == i)
    head[im_end] = 1.25 * head[token]
    return save_model(work / "model", embed, head, tok)


@pytest.fixture(scope="module")
def plain(chatml) -> list[int]:
    """Plain greedy decoding of the rendered conversation, not stopped at the end of the turn."""
    tok = chatml_tokenizer()
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    out = SpeculativeGenerator.from_pretrained(chatml, method="ar").generate(ids, max_new_tokens=BUDGET).token_ids
    assert tok.convert_tokens_to_ids("<|im_end|>") in out[2:]  # the turn ends, after some text
    return out


def test_render_is_the_models_template_and_the_turn_ends_at_its_closing_token():
    tok = chatml_tokenizer()
    assert render_chat(tok, MESSAGES) == tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert render_chat(tok, MESSAGES).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert end_of_turn_ids(tok) == [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    # Llama 3's layout: the closing special token is <|eot_id|>, whatever follows it.
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.chat_template = ("{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
                         "{{ m.content | trim }}<|eot_id|>{% endfor %}")
    assert end_of_turn_ids(tok)[1:] == [tok.convert_tokens_to_ids("<|eot_id|>")]


def test_the_embedded_models_ship_the_code_template():
    """Theirs is the code template the trainer gives every tokenizer it makes: a conversation
    stays a source file, and the reply ends at EOS alone (no closing token)."""
    from transformers import AutoTokenizer

    template = CODE_CHAT_TEMPLATE_FILE.read_text()
    for name in ("qd-stdlib-target", "qd-stdlib-draft"):
        assert (ASSETS_DIR / name / "chat_template.jinja").read_text() == template
    tok = AutoTokenizer.from_pretrained(str(EMBEDDED))
    msgs = [{"role": "system", "content": "Python only.\nNo prose."}, {"role": "user", "content": "def f(x):"},
            {"role": "assistant", "content": "    return x"}, {"role": "user", "content": ""},
            {"role": "user", "content": "def g():\n"}]
    assert render_chat(tok, msgs) == "# Python only.\n# No prose.\ndef f(x):\n    return x\ndef g():\n"
    assert render_chat(tok, [{"role": "user", "content": "import os"}]) == "import os"
    assert end_of_turn_ids(tok) == [tok.eos_token_id]
    tok.chat_template = None
    with pytest.raises(NoChatTemplateError, match="model qd has no chat template"):
        render_chat(tok, msgs, "qd")


@pytest.mark.parametrize("method", ["ar", "draft"])
def test_chat_stops_at_the_end_of_turn_token(chatml, plain, method):
    """Greedy chat output is plain greedy output cut before <|im_end|>, which is kept out of
    the text, whether the token comes alone (ar) or inside an accepted draft (draft)."""
    gen = SpeculativeGenerator.from_pretrained(chatml, chatml if method == "draft" else None, method=method)
    im_end = gen.tokenizer.convert_tokens_to_ids("<|im_end|>")
    want = plain[:plain.index(im_end)]
    out = gen.generate(messages=MESSAGES, max_new_tokens=BUDGET, num_speculative_tokens=4)
    assert out.token_ids == want and out.stats.finish_reason == "stop"
    assert out.text == gen.tokenizer.decode(want) and "<|im_end|>" not in out.text
    stream = gen.stream(messages=MESSAGES, max_new_tokens=BUDGET, num_speculative_tokens=4)
    assert "".join(chunk.text for chunk in stream) == out.text
    assert gen.generate(gen.chat_ids(MESSAGES), max_new_tokens=BUDGET).token_ids == plain  # a prompt: no turn


def test_messages_and_a_prompt_exclude_each_other():
    gen = SpeculativeGenerator.from_pretrained(method="ar")
    with pytest.raises(ValueError, match="not both"):
        gen.generate("def f():", messages=MESSAGES)
    with pytest.raises(ValueError, match="give a prompt or messages"):
        gen.stream()
    with pytest.raises(ValueError, match="role 'robot'"):
        gen.generate(messages=[{"role": "robot", "content": "hi"}])


def run_cli(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["generate", *args])
    return code, out.getvalue(), err.getvalue()


def test_cli_chat_and_messages_file(chatml, plain, tmp_path):
    im_end = chatml_tokenizer().convert_tokens_to_ids("<|im_end|>")
    file = tmp_path / "chat.json"
    file.write_text(json.dumps(MESSAGES[1:]))
    for source in (["--chat", MESSAGES[1]["content"]], ["--messages", str(file)]):
        code, out, _ = run_cli("--model", str(chatml), "--method", "ar", "--system", MESSAGES[0]["content"],
                               "--max-new-tokens", str(BUDGET), "--json", *source)
        result = json.loads(out)
        assert code == 0 and result["token_ids"] == plain[:plain.index(im_end)] and result["settings"]["chat"]


@pytest.mark.parametrize("content, error", [
    ("[{\"role\": \"user\"", "is not JSON"),
    ("{\"role\": \"user\", \"content\": \"hi\"}", "must be a non-empty list"),
    ("[{\"role\": \"robot\", \"content\": \"hi\"}]", "message 0 has role 'robot'; use one of"),
    ("[{\"role\": \"user\"}]", r"message 0 \(user\) has no content"),
    ("[{\"role\": \"user\", \"content\": 3}]", "content that is not a string"),
])
def test_cli_bad_messages_file(tmp_path, content, error):
    import re

    file = tmp_path / "chat.json"
    file.write_text(content)
    code, out, err = run_cli("--messages", str(file))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert re.search(f"quickdraft: error: messages file .*{error}", err)


def test_cli_model_without_a_template(tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(EMBEDDED, bare, ignore=shutil.ignore_patterns("chat_template.jinja", "*.png"))
    code, out, err = run_cli("--model", str(bare), "--method", "ar", "--chat", "hi")
    assert code == 2 and out == ""
    assert err == ("quickdraft: error: model bare has no chat template, so it cannot take messages; give it a "
                   "plain prompt (`quickdraft generate --prompt`, generate(prompt), or /v1/completions)\n")
    code, _, err = run_cli("--prompt", "x", "--system", "y")
    assert code == 2 and "--system goes with --chat or --messages" in err


@pytest.mark.slow  # 10-20 s: sorted first (conftest.py), never a worker's last test
def test_server_chat_uses_the_template_and_refuses_a_model_without_one(chatml, plain, tmp_path):
    """The batched engine ends the reply at <|im_end|> too; a model without a template is a 400."""
    from serving import ServerProcess

    bare = tmp_path / "bare"
    shutil.copytree(chatml, bare, ignore=shutil.ignore_patterns("chat_template.jinja"))
    with ThreadPoolExecutor(2) as pool:  # the two start side by side
        servers = list(pool.map(lambda path: ServerProcess(["--model", str(path), "--method", "ar", "--threads", "1"],
                                                           tmp_path / f"{path.name}.log"), (chatml, bare)))
    try:
        with_template, without = servers
        body = {"model": str(chatml), "messages": MESSAGES, "max_tokens": BUDGET, "temperature": 0}
        status, reply = with_template.post("/v1/chat/completions", body)
        tok = chatml_tokenizer()
        want = tok.decode(plain[:plain.index(tok.convert_tokens_to_ids("<|im_end|>"))])
        assert status == 200 and reply["choices"][0]["message"]["content"] == want
        assert reply["choices"][0]["finish_reason"] == "stop"
        assert reply["usage"]["prompt_tokens"] == len(tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
                                                      ["input_ids"])
        status, error = without.post("/v1/chat/completions", {**body, "model": str(bare)})
        assert status == 400 and error["error"]["code"] == "no_chat_template"
        assert error["error"]["message"].startswith(f"model {bare} has no chat template")
        status, _ = without.post("/v1/completions", {"model": str(bare), "prompt": "def f():", "max_tokens": 2})
        assert status == 200  # a plain prompt still works
    finally:
        for server in servers:
            server.stop()


def test_auto_gives_chats_their_own_choice(chatml, plain, tmp_path, monkeypatch, capsys):
    """``--method auto`` calibrates chats apart from completions (its chat prompts through
    the model's template, its own cache entry), a chat decodes with that choice, losslessly
    (cut at the end of the turn), and the CLI says which choice a chat got."""
    from quickdraft.chat import chat_prompt_ids
    from quickdraft.policy.method_choice import CHAT_CALIBRATION, calibration_ids

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    tok = chatml_tokenizer()
    ids = calibration_ids(tok, "chat")
    assert len(ids) == len(CHAT_CALIBRATION)
    assert ids[1] == chat_prompt_ids(tok, [{"role": "user", "content": CHAT_CALIBRATION[1]}])
    with pytest.raises(ValueError, match="unknown calibration kind 'poem'"):
        calibration_ids(tok, "poem")
    gen = SpeculativeGenerator.from_pretrained(chatml, chatml, method="auto")
    chats = gen.for_chats()
    assert chats is not gen and gen.for_chats() is chats and chats.for_chats() is chats
    assert (gen.method_choice.kind, chats.method_choice.kind) == ("completion", "chat")
    assert chats.method_choice.path != gen.method_choice.path  # one cache entry each
    assert "for chats" in chats.method_choice.summary()
    ar = SpeculativeGenerator.from_pretrained(chatml, method="ar")
    assert ar.for_chats() is ar  # not auto: one method for every request
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    want = plain[:plain.index(im_end)]
    assert gen.generate(messages=MESSAGES, max_new_tokens=BUDGET).token_ids == want
    stream = gen.stream(messages=MESSAGES, max_new_tokens=BUDGET)
    assert "".join(chunk.text for chunk in stream) == tok.decode(want)
    code, out, err = run_cli("--model", str(chatml), "--draft", str(chatml), "--method", "auto", "--system",
                             MESSAGES[0]["content"], "--chat", MESSAGES[1]["content"], "--max-new-tokens",
                             str(BUDGET), "--json")
    assert code == 0 and json.loads(out)["token_ids"] == want
    assert "for chats" in err and "measuring" not in err  # cached above
    # A generator built for chats measures chats alone (a chat from the CLI: one measurement)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "fresh"))
    code, out, err = run_cli("--model", str(chatml), "--draft", str(chatml), "--method", "auto", "--system",
                             MESSAGES[0]["content"], "--chat", MESSAGES[1]["content"], "--max-new-tokens",
                             str(BUDGET), "--json")
    assert code == 0 and json.loads(out)["token_ids"] == want
    assert err.count("measuring which method") == 1 and "for chats, once" in err
    only = SpeculativeGenerator.from_pretrained(chatml, chatml, method="auto", kind="chat")
    assert only.method_choice.kind == "chat" and only.for_chats() is only and not only.method_choice.measured
