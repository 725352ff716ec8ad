"""Chat messages to a prompt through the model's own chat template, and the tokens that end
the model's turn, for the Python API, the CLI and the server alike.

A model whose tokenizer has no ``chat_template`` cannot be chatted with: :func:`render_chat`
raises :class:`NoChatTemplateError` instead of inventing a format the model never saw.
(The embedded code models ship one: ``chat_template.jinja`` beside their weights.)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

#: The roles a message may have (the OpenAI API's, less tools); a template may refuse some.
ROLES = ("system", "developer", "user", "assistant")
#: A message: ``{"role": "user", "content": "..."}``.
Message = dict[str, str]
# The assistant's content when rendering a one-turn conversation to see what the template
# writes after a reply; plain letters, so no template trims or escapes it.
_REPLY = "QuickdraftReplyEndsHere"


class ChatTemplateError(ValueError):
    """The messages cannot be rendered: malformed, or refused by the model's template."""


class NoChatTemplateError(ChatTemplateError):
    """The model has no chat template, so messages have no prompt to become."""


def has_chat_template(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return bool(template)  # a str, or a dict of named templates


def check_messages(messages: object) -> list[Message]:
    """``messages`` as a list of ``{"role", "content"}`` dicts, or a :class:`ChatTemplateError`
    naming the first problem (not a list, an unknown role, content missing or not text)."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError('messages must be a non-empty list of {"role": ..., "content": ...} objects')
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"message {i} is not an object with role and content")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ChatTemplateError(f"message {i} has role {role!r}; use one of: {', '.join(ROLES)}")
        if not isinstance(content, str):
            what = "has no content" if content is None else "has content that is not a string"
            raise ChatTemplateError(f"message {i} ({role}) {what}")
        checked.append({"role": role, "content": content})
    return checked


def read_messages_file(path: str | Path) -> list[Message]:
    """The conversation in a JSON file: a list of ``{"role", "content"}`` objects (or an
    OpenAI request body with ``"messages"``); a ``ValueError`` saying what is wrong."""
    from .jsonl import check_input_file

    path = check_input_file(path, "messages file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"messages file {path} is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"messages file {path} is not JSON ({exc.msg} at line {exc.lineno}, column "
                         f"{exc.colno}); give a list of {{\"role\": ..., \"content\": ...}} objects") from None
    except OSError as exc:
        raise ValueError(f"cannot read messages file {path}: {exc.strerror or exc}") from None
    if isinstance(data, dict) and "messages" in data:
        data = data["messages"]
    try:
        return check_messages(data)
    except ChatTemplateError as exc:
        raise ValueError(f"messages file {path}: {exc}") from None


def render_chat(tokenizer, messages: Sequence[Message], model: str = "this model") -> str:
    """The prompt text for ``messages``: the model's template with the generation prompt
    (what ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)`` gives).
    Tokenise it without special tokens: the template writes its own."""
    if not has_chat_template(tokenizer):
        raise NoChatTemplateError(
            f"model {model} has no chat template, so it cannot take messages; give it a plain prompt "
            "(`quickdraft generate --prompt`, generate(prompt), or /v1/completions)")
    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # jinja2 errors, including a template's raise_exception
        raise ChatTemplateError(f"the chat template refused these messages: {str(exc).splitlines()[0]}") from None


def chat_prompt_ids(tokenizer, messages: Sequence[Message], model: str = "this model") -> list[int]:
    """The token ids of the rendered ``messages`` (see :func:`render_chat`)."""
    text = render_chat(tokenizer, messages, model)
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def end_of_turn_ids(tokenizer) -> list[int]:
    """The tokens that end the assistant's turn: the tokenizer's EOS and the special token
    the template writes right after an assistant message (``<|im_end|>`` in ChatML,
    ``<|eot_id|>`` in Llama 3), found by rendering a one-turn conversation. A template that
    closes a reply with plain text (or nothing) adds no token."""
    ids = []
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        ids.append(eos)
    closing = _closing_token(tokenizer)
    if closing is not None:
        ids.append(closing)
    return list(dict.fromkeys(ids))


def _closing_token(tokenizer) -> int | None:
    if not has_chat_template(tokenizer):
        return None
    turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _REPLY}]
    try:
        text = tokenizer.apply_chat_template(turn, tokenize=False)
    except Exception:  # a template that refuses this conversation has no turn end we can see
        return None
    at = text.rfind(_REPLY)
    if at < 0:
        return None
    after = tokenizer(text[at + len(_REPLY):], add_special_tokens=False, verbose=False)["input_ids"]
    return after[0] if after and after[0] in _special_ids(tokenizer) else None


def _special_ids(tokenizer) -> set[int]:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(tokenizer.all_special_ids) | {i for i, token in added.items() if getattr(token, "special", False)}
