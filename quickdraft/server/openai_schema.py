"""The OpenAI API objects the server reads and writes (the subset it implements).

Requests are validated here, so a bad value is a 400 with OpenAI's error object naming
the parameter. Responses carry two additions the official clients ignore: ``timings``
(llama.cpp's names: ``draft_n`` drafted tokens, ``draft_n_accepted`` accepted ones, plus
the mean accepted tokens per target pass) and, on streamed chunks, ``quickdraft`` (the
step's token counts and its text split into accepted-draft and target segments).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from ..decoding.sampling import MAX_TEMPERATURE
from ..decoding.stats import GenerationStats

MAX_STOP_STRINGS = 4  # as the OpenAI API
SEED_RANGE = 2**63  # a torch generator takes a signed 64-bit seed; seed + i (choice i) must stay in it
#: Requests are strict: ``"stream": "yes"`` or ``[[false]]`` as token ids are 400s, never
#: coerced (an int is still a valid float).
STRICT = ConfigDict(extra="ignore", strict=True)


def _encodable(text: str) -> str:
    """A lone surrogate (``"\\ud800"`` in JSON) cannot be tokenized or echoed as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the text has a lone UTF-16 surrogate (like \\ud800); send valid Unicode") from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions. Unknown fields are ignored (as
    OpenAI-compatible servers do); fields that would change the output in ways this
    server does not implement are refused instead of silently ignored."""

    model_config = STRICT

    model: Text
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)  # None: 1, as the OpenAI API
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # an extension (vLLM has it too): 0 = off
    n: int = Field(1, ge=1)
    seed: int | None = Field(None, ge=-SEED_RANGE, lt=SEED_RANGE)
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    user: Text | None = None

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, value):
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(value)}")
        return value

    def unsupported(self) -> str | None:
        """The first parameter set to something this server cannot honour, if any."""
        if self.logprobs not in (None, False, 0):
            return "logprobs"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                return name
        if self.logit_bias:
            return "logit_bias"
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, token ids or a
    list of token id lists (one choice set per prompt)."""

    prompt: Text | list[int] | list[list[int]] | list[Text]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo"
        if self.suffix:
            return "suffix"
        if self.best_of not in (None, 1, self.n):
            return "best_of"
        return super().unsupported()


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    tools: list | None = None
    response_format: dict | None = None

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format"  # JSON modes constrain decoding, which this server does not
        return super().unsupported()


# ---- responses -------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Timings(BaseModel):
    """Speculative-decoding figures of a response, named as llama.cpp's server does
    (``prompt_*``: the prefill pass, ``predicted_*``: the passes after it, ``draft_n``:
    draft tokens proposed, ``draft_n_accepted``: those the target accepted) plus
    ``mean_accepted_tokens`` (new tokens / target passes), ``target_passes`` and
    ``draft_k``: the most draft tokens one step proposed, i.e. the k this response was
    decoded with (0: nothing was drafted, e.g. the batch policy chose plain decoding)."""

    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    predicted_per_second: float | None
    draft_n: int
    draft_n_accepted: int
    acceptance_rate: float | None
    mean_accepted_tokens: float
    target_passes: int
    draft_k: int

    @classmethod
    def of(cls, stats: GenerationStats) -> Timings:
        d = stats.to_dict()
        return cls(
            prompt_n=stats.prompt_tokens,
            prompt_ms=stats.prefill_seconds * 1000,
            predicted_n=stats.new_tokens,
            predicted_ms=stats.decode_seconds * 1000,
            predicted_per_second=d["tokens_per_second"],
            draft_n=stats.drafted_tokens,
            draft_n_accepted=stats.accepted_tokens,
            acceptance_rate=d["acceptance_rate"],
            mean_accepted_tokens=stats.mean_accepted_tokens,
            target_passes=stats.target_forward_passes,
            draft_k=len(stats.drafted_per_position),
        )


class StepInfo(BaseModel):
    """A streamed chunk's step: ``tokens`` emitted, the first ``drafted`` of them accepted
    draft tokens; ``segments`` = the chunk's text as ``[text, from_draft]`` pairs."""

    tokens: int
    drafted: int
    segments: list[tuple[str, bool]]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    quickdraft: StepInfo | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None
    quickdraft: StepInfo | None = None


class APIResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list
    usage: Usage | None = None
    timings: Timings | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
