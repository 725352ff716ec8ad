"""``/openapi.json`` as the server behaves: FastAPI's default says validation errors are
422 (they are 400 with OpenAI's error object), lists no 404, 401, 413, 429 or 503, and
declares JSON for ``/metrics`` (Prometheus text) and for streamed completions (SSE)."""

from __future__ import annotations

from fastapi.openapi.utils import get_openapi

from .auth import PROTECTED_PREFIX
from .openai_schema import APIResponse, ErrorResponse

ERROR = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
GENERATION_ERRORS = {
    "404": "unknown model",
    "413": "request body too large",
    "429": "queue full (Retry-After)",
    "503": "shutting down",
}


def _error(description: str) -> dict:
    return {"description": description, "content": ERROR}


def truthful_openapi(app) -> dict:
    """FastAPI's schema of ``app``, corrected (cached on the app as FastAPI does)."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    components["ErrorResponse"] = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(components["ErrorResponse"].pop("$defs", {}))
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            responses.pop("422", None)
            responses["400"] = _error("invalid request (or Host header)")
            responses["500"] = _error("server error")
            if path.startswith(PROTECTED_PREFIX):
                responses["401"] = _error("missing or wrong API key (when the server has one)")
            if "{" in path:
                responses["404"] = _error("unknown model")
            if method == "post":
                responses.update({code: _error(why) for code, why in GENERATION_ERRORS.items()})
                responses["200"]["content"] = {
                    "application/json": {"schema": {"$ref": "#/components/schemas/APIResponse"}},
                    "text/event-stream": {"schema": {"type": "string"}, "description": "with stream: true"},
                }
    components["APIResponse"] = APIResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(components["APIResponse"].pop("$defs", {}))
    schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
    schema["paths"]["/health"]["get"]["responses"]["503"] = {"description": "the engine cannot make progress",
                                                             "content": {"application/json": {}}}
    app.openapi_schema = schema
    return schema
