"""Chat messages to a prompt: the checkpoint's own ``chat_template`` when its tokenizer has
one, else :data:`CODE_CHAT_TEMPLATE` for code-completion models such as the embedded ones.

The code template (documented in docs/server.md) keeps a conversation a source file the
model can continue: system (and developer) messages become ``# `` comment lines, user and
assistant messages are copied as they are, each message starts on a new line, and nothing
is added for the reply: the model continues the last message. So one user message
``def f(x):`` is the prompt ``def f(x):``, exactly what ``/v1/completions`` would get.
"""

from __future__ import annotations

CODE_CHAT_TEMPLATE = (
    "{%- set ns = namespace(last='\\n') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] in ['system', 'developer'] -%}"
    "{%- set text = '# ' + (message['content'].split('\\n') | join('\\n# ')) + '\\n' -%}"
    "{%- else -%}"
    "{%- set text = message['content'] -%}"
    "{%- endif -%}"
    "{%- if text -%}"
    "{%- if not ns.last.endswith('\\n') -%}{{ '\\n' }}{%- endif -%}"
    "{{- text -}}"
    "{%- set ns.last = text -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


class ChatTemplateError(ValueError):
    """The messages do not fit the template (a checkpoint's template may refuse roles)."""


def chat_template(tokenizer) -> tuple[str, str]:
    """The template to use and where it comes from ("checkpoint" or "quickdraft-code")."""
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, str) and own:
        return own, "checkpoint"
    return CODE_CHAT_TEMPLATE, "quickdraft-code"


def render_chat(tokenizer, messages: list[dict]) -> str:
    """The prompt text for ``messages`` (``[{"role": ..., "content": str}, ...]``)."""
    template, source = chat_template(tokenizer)
    try:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=source == "checkpoint"
        )
    except Exception as exc:  # jinja2 errors, including a template's raise_exception
        raise ChatTemplateError(f"the chat template refused these messages: {str(exc).splitlines()[0]}") from None
