"""Who may talk to the server: an API key (OpenAI's ``Authorization: Bearer``) and, on a
loopback bind, the Host names a browser may use to reach it.

The Host check stops DNS rebinding: a web page whose name resolves to 127.0.0.1 would
otherwise be same-origin with the server and could read its responses.
"""

from __future__ import annotations

import hmac
import ipaddress
import json

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
PROTECTED_PREFIX = "/v1/"  # the API; /health, /metrics and the playground's page stay open, as vLLM's


def is_loopback(host: str) -> bool:
    """``host`` (a name or an address) only reaches this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: bytes) -> str:
    """The name in a Host header, without port or IPv6 brackets, lower case."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


def _error(status: int, message: str, code: str, headers: dict | None = None):
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return {"type": "http.response.start", "status": status, "headers": raw}, {"type": "http.response.body",
                                                                              "body": body}


class Guard:
    """ASGI middleware: a Host outside ``allowed_hosts`` (None: any) is a 400; a request to
    /v1/ without ``Authorization: Bearer <api_key>`` (when a key is set) is a 401 with
    OpenAI's error object. The key is compared in constant time."""

    def __init__(self, app, api_key: str | None = None, allowed_hosts: list[str] | None = None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.hosts = {h.lower().strip("[]") for h in allowed_hosts} if allowed_hosts is not None else None

    def refusal(self, scope) -> tuple[int, str, str, dict | None] | None:
        headers = dict(scope.get("headers") or [])
        if self.hosts is not None and host_name(headers.get(b"host", b"")) not in self.hosts:
            return 400, "invalid Host header: this server answers only to " + ", ".join(sorted(self.hosts)) + \
                " (--allowed-hosts)", "invalid_host", None
        if self.key is not None and scope["path"].startswith(PROTECTED_PREFIX):
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                return 401, "missing or incorrect API key: send `Authorization: Bearer <key>`", \
                    "invalid_api_key", {"WWW-Authenticate": "Bearer"}
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refused = self.refusal(scope)
        if refused is None:
            return await self.app(scope, receive, send)
        start, body = _error(*refused)
        await send(start)
        await send(body)


def default_allowed_hosts(bind: str, extra: list[str]) -> list[str] | None:
    """A loopback bind answers to loopback names (and ``extra``); any other bind to any Host
    unless ``extra`` names some."""
    if is_loopback(bind):
        return [*LOOPBACK_NAMES, *extra]
    return list(extra) or None


def guard_settings(args) -> dict:
    """ServerState's limits, API key and Host allowlist from `quickdraft serve`'s options;
    warns on stderr when a non-loopback bind has no key."""
    import sys

    from .limits import Limits

    if args.api_key is None and not is_loopback(args.host):
        print(f"quickdraft: warning: listening on {args.host} without an API key: anyone who can reach it "
              "can use it (--api-key or QUICKDRAFT_API_KEY)", file=sys.stderr, flush=True)
    return {"limits": Limits(args.max_n, args.max_prompts, args.max_request_tokens), "api_key": args.api_key,
            "allowed_hosts": default_allowed_hosts(args.host, args.allowed_hosts)}
