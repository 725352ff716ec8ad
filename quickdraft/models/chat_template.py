"""Render a model's chat template (Jinja) as transformers 5 does, without importing it.

Same environment: a sandbox that cannot change what it is given, ``trim_blocks`` and
``lstrip_blocks``, loop controls, a ``{% generation %}`` block that renders its body,
``tojson`` without HTML escaping, ``raise_exception``, ``strftime_now``, and restricted
``dict`` and ``namespace``. Templates come from model repositories: untrusted code, hence
the sandbox. Messages are passed as transformers passes them: keys whose value is None
dropped, a reasoning field under each of the names templates read.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime

#: Names of a message's reasoning; templates read the first, gpt-oss ones ``thinking``.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = False,
                         tools: list[dict] | None = None, documents: list[dict] | None = None, **variables) -> str:
    """``template`` rendered for one conversation; template errors (including the template's
    own ``raise_exception``) propagate as ``jinja2`` exceptions."""
    chat = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    return _compile(template).render(messages=chat, tools=tools, documents=documents,
                                     add_generation_prompt=add_generation_prompt, **variables)


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: marks the assistant's tokens for
        training masks; rendering only needs its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """``namespace()`` that refuses underscore names (no reach into Python internals)."""

        def __init__(*args, **kwargs):  # noqa: N805 (Jinja's signature: namespace(self=...) works)
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                _check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            _check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot store {name!r} on a namespace")

    class Dict:
        """``dict(...)`` and ``dict.fromkeys(...)``, nothing else of the type."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=Dict(), namespace=Namespace)
    return env.from_string(template)
