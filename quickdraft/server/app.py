"""The FastAPI application: OpenAI-compatible routes, health, metrics and the playground.

Every client mistake is answered with OpenAI's error object and a 4xx (400 for a bad
value, 404 for an unknown model or route, 413 for an oversized body, 429 when the queue
is full); only a bug on our side is a 500, and it fails that request alone.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
import traceback
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..chat import ChatTemplateError, NoChatTemplateError, chat_prompt_ids, end_of_turn_ids
from ..decoding.engine import Step
from ..decoding.sampling import SamplingParams
from ..decoding.stats import GenerationStats
from ..decoding.stopping import StopConditions
from ..text import TextAssembler, stop_strings
from .auth import Guard
from .limits import LimitError, Limits
from .metrics import ServerMetrics
from .openai_schema import (
    SEED_RANGE,
    APIResponse,
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    CompletionChoice,
    CompletionRequest,
    ErrorDetail,
    ErrorResponse,
    SamplingRequest,
    StepInfo,
    Timings,
    Usage,
)
from .openapi import truthful_openapi
from .scheduler import Event, Job, QueueFullError, Scheduler, ShuttingDownError

STATIC = Path(__file__).parent / "static"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI API's default for /v1/completions


@dataclass
class ServerState:
    """What the routes need: the model's identity and tokenizer, and the scheduler."""

    model_name: str
    tokenizer: object
    eos_token_ids: list[int]
    context_length: int
    vocab_size: int
    scheduler: Scheduler
    metrics: ServerMetrics
    settings: dict  # method, k, engine, ...: reported by /health and the playground
    chat_max_tokens: int = 256
    max_body_bytes: int = 1 << 20
    created: int = 0
    limits: Limits = Limits()
    api_key: str | None = None  # None: no key asked for
    allowed_hosts: list[str] | None = None  # Host header names answered (None: any)


class APIError(Exception):
    """A request the server refuses: becomes OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers


class ClientGone(Exception):
    """The client closed the connection while waiting for a non-streamed response."""


def error_response(exc: APIError) -> JSONResponse:
    body = ErrorResponse(error=ErrorDetail(message=exc.message, type=exc.type, param=exc.param, code=exc.code))
    return JSONResponse(body.model_dump(), status_code=exc.status, headers=exc.headers)


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is a 413, whether it announces its
    length or streams it (it is never read past the limit)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = APIError(413, f"the request body is larger than {self.max_bytes} bytes", code="body_too_large")
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await error_response(too_large)(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise StarletteHTTPException(413, too_large.message)
            return message

        return await self.app(scope, limited, send)


def create_app(state: ServerState) -> FastAPI:
    """The application for one loaded model. The caller runs ``state.scheduler.run()``
    (`quickdraft serve` does, in the main thread); the app stops it when it shuts down."""

    async def lifespan(app: FastAPI):
        yield
        state.scheduler.stop()

    app = FastAPI(title="quickdraft", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.add_middleware(BodyLimit, max_bytes=state.max_body_bytes)
    app.add_middleware(Guard, api_key=state.api_key, allowed_hosts=state.allowed_hosts)  # outermost: first
    app.openapi = lambda: truthful_openapi(app)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.state.quickdraft = state
    scheduler, metrics, tokenizer = state.scheduler, state.metrics, state.tokenizer
    end_of_turn = end_of_turn_ids(tokenizer)  # a chat's reply ends there (e.g. <|im_end|>)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        metrics.label(metrics.rejected, "bad_request" if exc.status != 429 else "queue_full").inc()
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        metrics.label(metrics.rejected, "bad_request").inc()
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(exc.status_code)
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see /docs"
        return error_response(APIError(exc.status_code, message, code=code, headers=exc.headers))  # 405: Allow

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        return error_response(APIError(500, f"internal error: {type(exc).__name__}", type="server_error"))

    @app.get("/", include_in_schema=False)
    async def playground():
        return FileResponse(STATIC / "playground.html", media_type="text/html")

    @app.get("/health")
    async def health():
        problem = scheduler.problem()
        body = {"status": problem or "ok", "model": state.model_name, **state.settings, **scheduler.state()}
        return JSONResponse(body, status_code=503 if problem else 200)

    @app.get("/metrics", response_class=Response)
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict:
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "quickdraft",
                "max_model_len": state.context_length}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        check_model(state, model)
        return model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        metrics.label(metrics.requests, "completions").inc()
        check_request(state, body)
        prompts = body.prompt if isinstance(body.prompt, list) and body.prompt and not isinstance(
            body.prompt[0], int) else [body.prompt]
        check_shape(state, body.n, len(prompts))  # before tokenizing them
        ids = [tokenizer(p, verbose=False)["input_ids"] if isinstance(p, str) else list(p) for p in prompts]
        if any(not 0 <= t < state.vocab_size for p in ids for t in p):
            raise APIError(400, f"token ids in the prompt must be in [0, {state.vocab_size})", param="prompt",
                           code="invalid_value")
        return await generate(request, body, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        metrics.label(metrics.requests, "chat").inc()
        check_request(state, body)
        check_shape(state, body.n, 1)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            ids = chat_prompt_ids(tokenizer, messages, state.model_name)
        except NoChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages", code="no_chat_template") from None
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages") from None
        return await generate(request, body, [ids], chat=True)

    async def generate(request: Request, body: SamplingRequest, prompts: list[list[int]], chat: bool):
        max_tokens = body.max_tokens
        if chat and body.max_completion_tokens is not None:
            max_tokens = body.max_completion_tokens
        param = "messages" if chat else "prompt"
        for ids in prompts:
            check_context(state, ids, max_tokens, param)
        default = state.chat_max_tokens if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
        budgets = [max_tokens or min(default, state.context_length - len(ids)) for ids in prompts]
        try:
            state.limits.check_tokens([len(ids) for ids in prompts], budgets, body.n, param)
        except LimitError as exc:
            raise APIError(400, str(exc), param=exc.param, code="request_too_large") from None
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        stops = stop_strings(body.stop)
        stop_ids = [*state.eos_token_ids, *end_of_turn] if chat else state.eos_token_ids
        temperature = 1.0 if body.temperature is None else body.temperature
        jobs = []
        for p, (ids, budget) in enumerate(zip(prompts, budgets)):
            for j in range(body.n):
                seed = wrapped_seed(body.seed + j) if body.seed is not None else (
                    random.SystemRandom().randrange(2**31) if temperature > 0 else None)
                params = SamplingParams(temperature, body.top_k or 0, 1.0 if body.top_p is None else body.top_p, seed)
                stop = StopConditions(budget, stop_ids, stops, tokenizer)
                jobs.append(Job(p * body.n + j, _tensor(ids), params, stop, events, loop))
        try:
            scheduler.submit(jobs)
        except QueueFullError as exc:
            raise APIError(429, str(exc), code="queue_full", type="rate_limit_exceeded",
                           headers={"Retry-After": "1"}) from None
        except ShuttingDownError as exc:
            raise APIError(503, str(exc), code="server_shutdown", type="server_error") from None
        try:
            reply = Reply(state, chat, body, jobs, [len(ids) for ids in prompts], stops)
            if body.stream:
                return StreamingResponse(reply.stream(events), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                         background=BackgroundTask(scheduler.cancel, jobs))
        except BaseException:  # the jobs are queued: whatever fails here must give their places back
            scheduler.cancel(jobs)
            raise
        try:
            return await reply.whole(events, request)
        except ClientGone:
            return Response(status_code=499)
        finally:
            scheduler.cancel(jobs)  # a no-op for finished jobs

    return app


def _tensor(ids: list[int]):
    import torch

    return torch.tensor(ids, dtype=torch.long)


def check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise APIError(404, f"the model `{model}` does not exist; this server serves `{state.model_name}` "
                       "(GET /v1/models)", param="model", code="model_not_found")


def check_request(state: ServerState, body: SamplingRequest) -> None:
    check_model(state, body.model)
    name = body.unsupported()
    if name:
        raise APIError(400, f"`{name}` is not supported by this server; leave it out", param=name,
                       code="unsupported_parameter")


def check_shape(state: ServerState, n: int, prompts: int) -> None:
    """The request's size, before any work for it (:mod:`.limits`)."""
    try:
        state.limits.check_shape(n, prompts, state.scheduler.max_queue)
    except LimitError as exc:
        raise APIError(400, str(exc), param=exc.param, code="request_too_large") from None


def wrapped_seed(seed: int) -> int:
    """``seed`` + i kept in a torch generator's signed 64-bit range (wraps around)."""
    return (seed + SEED_RANGE) % (2 * SEED_RANGE) - SEED_RANGE


def check_context(state: ServerState, ids: list[int], max_tokens: int | None, param: str) -> None:
    """OpenAI's rule: prompt + max_tokens must fit the context (without max_tokens, the
    prompt must leave room for one token)."""
    n, context = len(ids), state.context_length
    if n == 0:
        empty = "the prompt is empty" if param == "prompt" else "the messages render to no tokens"
        raise APIError(400, f"{empty}; give at least one token", param=param)
    if n + (max_tokens or 1) > context:
        asked = f"; you asked for {n + max_tokens} tokens ({n} in the {param}, {max_tokens} for the completion)" \
            if max_tokens else f"; the {param} has {n} tokens"
        raise APIError(400, f"this model's maximum context length is {context} tokens{asked}. "
                       f"Shorten the {param} or lower max_tokens.", param=param, code="context_length_exceeded")


def validation_error(exc: RequestValidationError) -> APIError:
    """The first validation error as a 400, naming the parameter."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    # A union (prompt: text, ids or lists of either) fails once per member: the member that
    # got deepest into the value says best what is wrong ([[false]]: an id must be an integer).
    same_field = [e for e in errors if tuple(e.get("loc", ()))[:2] == tuple(first.get("loc", ()))[:2]]
    first = max(same_field, key=lambda e: len(e.get("loc", ())), default=first)
    # Union members name themselves in loc (``function-after[...]``, ``list[int]``): not a field.
    loc = [str(part) for part in first.get("loc", ()) if part != "body" and "[" not in str(part)]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON ({detail}); send a JSON object",
                        code="invalid_json")
    if not loc:
        return APIError(400, "the request body must be a JSON object with the request's fields")
    param = loc[0]
    got = first.get("input")
    shown = "" if first.get("type") == "missing" or isinstance(got, dict | list) else f" (got {got!r})"
    return APIError(400, f"invalid value for `{'.'.join(loc)}`: {first.get('msg', 'invalid')}{shown}",
                    param=param, code="invalid_value")


def merged(stats: list[GenerationStats]) -> GenerationStats:
    total = GenerationStats()
    for s in stats:
        total.merge(s)
    return total


class Reply:
    """Turns the events of a request's jobs into an OpenAI response or SSE stream."""

    def __init__(self, state: ServerState, chat: bool, body: SamplingRequest, jobs: list[Job],
                 prompt_lengths: list[int], stops: list[str]) -> None:
        self.state, self.chat, self.body, self.jobs = state, chat, body, jobs
        self.prompt_tokens = sum(prompt_lengths)
        self.text = {job.index: TextAssembler(state.tokenizer, stops) for job in jobs}
        self.stats: dict[int, GenerationStats] = {}
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _segments(self, event: Event) -> list[tuple[str, bool]]:
        """The text this event lets the client see, as (text, from_draft) segments."""
        assembler = self.text[event.index]
        segments = []
        chunk = assembler.push(Step(event.tokens, event.drafted))
        if chunk:
            segments += chunk.segments
        if event.finish:
            tail = assembler.flush()
            if tail:
                segments += tail.segments
        return segments

    def _usage(self) -> Usage:
        done = sum(s.new_tokens for s in self.stats.values())
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=done, total_tokens=self.prompt_tokens + done)

    def _response(self, choices: list, **extra) -> APIResponse:
        kind = ("chat.completion.chunk" if self.chat else "text_completion") if self.body.stream else (
            "chat.completion" if self.chat else "text_completion")
        return APIResponse(id=self.id, object=kind, created=self.created, model=self.state.model_name,
                              system_fingerprint=self.state.settings.get("fingerprint"), choices=choices, **extra)

    async def whole(self, events: asyncio.Queue, request: Request) -> JSONResponse:
        texts = {job.index: "" for job in self.jobs}
        finish: dict[int, str] = {}
        while len(finish) < len(self.jobs):
            event = await _next(events, request)
            if event.error:
                raise event_error(event)
            texts[event.index] += "".join(t for t, _ in self._segments(event))
            if event.finish:
                finish[event.index] = event.finish
                self.stats[event.index] = event.stats
        if self.chat:
            choices = [ChatChoice(index=i, message=AssistantMessage(content=texts[i]), finish_reason=finish[i])
                       for i in sorted(texts)]
        else:
            choices = [CompletionChoice(index=i, text=texts[i], finish_reason=finish[i]) for i in sorted(texts)]
        reply = self._response(choices, usage=self._usage(), timings=Timings.of(merged(list(self.stats.values()))))
        body = reply.model_dump()
        for choice in body["choices"]:
            choice.pop("quickdraft", None)
        return JSONResponse(body)

    def _chunk(self, index: int, text: str | None, finish: str | None = None, step: StepInfo | None = None,
               role: bool = False, timings: Timings | None = None) -> str:
        if self.chat:
            delta = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
        if step is not None:
            choice["quickdraft"] = step.model_dump()
        body = self._response([choice]).model_dump(exclude={"usage", "timings"})
        if self.body.include_usage:
            body["usage"] = None
        if timings is not None:
            body["timings"] = timings.model_dump()
        return sse(body)

    async def stream(self, events: asyncio.Queue) -> AsyncIterator[str]:
        try:
            async for chunk in self._stream(events):
                yield chunk
        except Exception:  # a bug on our side: this stream ends with an error event, not a cut connection
            traceback.print_exc(file=sys.stderr)
            yield sse(ErrorResponse(error=ErrorDetail(message="internal error", type="server_error",
                                                      code="server_error")).model_dump())
            yield "data: [DONE]\n\n"

    async def _stream(self, events: asyncio.Queue) -> AsyncIterator[str]:
        if self.chat:
            for job in self.jobs:
                yield self._chunk(job.index, "", role=True)
        pending = len(self.jobs)
        while pending:
            event = await events.get()
            if event.error:
                err = event_error(event)
                yield sse(ErrorResponse(error=ErrorDetail(message=err.message, type=err.type,
                                                          code=err.code)).model_dump())
                break
            segments = self._segments(event)
            step = StepInfo(tokens=len(event.tokens), drafted=event.drafted, segments=segments)
            yield self._chunk(event.index, "".join(t for t, _ in segments), step=step)
            if event.finish:
                pending -= 1
                self.stats[event.index] = event.stats
                yield self._chunk(event.index, None, finish=event.finish, timings=Timings.of(event.stats))
        else:
            if self.body.include_usage:
                body = self._response([], usage=self._usage(),
                                      timings=Timings.of(merged(list(self.stats.values())))).model_dump()
                yield sse(body)
        yield "data: [DONE]\n\n"


def event_error(event: Event) -> APIError:
    if event.error_code in ("server_error", "sampling_error"):
        return APIError(500, event.error, type="server_error", code=event.error_code)
    if event.error_code == "server_shutdown":
        return APIError(503, event.error, type="server_error", code="server_shutdown")
    return APIError(400, event.error, code=event.error_code)


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _next(events: asyncio.Queue, request: Request) -> Event:
    """The next event, watching for the client going away meanwhile."""
    get = asyncio.ensure_future(events.get())
    while True:
        done, _ = await asyncio.wait({get}, timeout=0.5)
        if done:
            return get.result()
        if await request.is_disconnected():
            get.cancel()  # not yet done: no event is lost
            raise ClientGone()


__all__ = ["APIError", "ServerState", "create_app"]
