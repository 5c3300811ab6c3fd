"""OpenAI wire formats (the subset we serve), as pydantic models; field names as OpenAI spells them.

Requests are validated strictly, as OpenAI does: an integer field takes a JSON integer (not "4", not
4.0, not true), a boolean a JSON boolean, a string a JSON string; a number field takes an integer
or a decimal. Every list stops at its first bad item (``fail_fast``): a million bad items cost one
error, not a million.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

MAX_N = 16  # n / best_of cap per request (each choice takes a KV slot)
REQUEST = ConfigDict(strict=True, extra="ignore")  # every request model's: OpenAI's types, unknown fields ignored

Ids = Annotated[list[int], Field(fail_fast=True)]  # token ids
Texts = Annotated[list[str], Field(fail_fast=True)]


class StreamOptions(BaseModel):
    model_config = REQUEST
    include_usage: bool = False


class Continuation(BaseModel):
    """Understudy's extension: continue a request another engine began. The new sequence is
    `prompt_token_ids + output_token_ids` (chat: the templated prompt; `messages` are then not
    rendered again), `output_token_ids` being the tokens the other engine reported (each chunk's
    `token_ids`); `max_tokens` and `seed` stay the original request's, usage counts the whole
    completion, and the text that follows is what the other engine would have sent next. (In a
    failover's batch the ids come framed raw, wire/batch_wire.py, and the batch puts them here as
    int64 arrays, unvalidated: the endpoint checks every id either way.)"""

    model_config = ConfigDict(strict=True, extra="forbid")

    prompt_token_ids: Ids = Field(min_length=1)
    output_token_ids: Ids = Field(default_factory=list)
    # A batch member's block keys as the router hashed them (wire/batch_wire.py); never from JSON.
    _router_keys: bytes | None = PrivateAttr(default=None)


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints; ranges as OpenAI documents them."""

    model_config = REQUEST

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | Texts | None = Field(default=None, validate_default=True)
    stop_token_ids: Ids | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(default=None, fail_fast=True)
    user: str | None = None
    return_token_ids: bool = False  # vLLM's extension: prompt ids and each choice's new ids
    response_format: dict | None = None  # only {"type": "text"}: structured output is refused, never ignored
    continuation: Continuation | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop sequences are allowed, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty strings")
        return stops

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: dict | None) -> dict | None:
        if v is not None and v.get("type") != "text":
            raise ValueError(f"type {v.get('type')!r} is not supported (structured output); only 'text' is")
        return v

    @model_validator(mode="after")
    def _unsupported(self):
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported (must be 0)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.continuation is not None and self.n != 1:
            raise ValueError("continuation needs n=1")
        return self


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    # list[int] first: a long id list then validates in one pass (smart mode tried the others on it
    # first: 180 us for 1.5k ids instead of 14)
    prompt: Ids | str | Texts | Annotated[list[Ids], Field(fail_fast=True)]
    max_tokens: int | None = Field(default=16, ge=1)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of ({self.best_of}) must equal n ({self.n}): ranking candidates is not supported")
        if self.echo or self.logprobs is not None or self.suffix is not None:
            raise ValueError("echo, logprobs and suffix are not supported")
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise ValueError("prompt must not be an empty list")
        return self


class ChatMessage(BaseModel):
    model_config = REQUEST
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | Annotated[list[dict], Field(fail_fast=True)] | None = None

    def text(self) -> str:
        """Content as text; a list of parts must hold only `{"type": "text", "text": ...}` parts."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        out = []
        for i, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content[{i}]: only text parts are supported, got type {part.get('type')!r}")
            out.append(part["text"])
        return "".join(out)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    tools: list | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.logprobs or self.tools:
            raise ValueError("logprobs and tools are not supported")
        return self


class ContinuedCompletion(CompletionRequest):
    """A completion the router continues on a new primary: `continuation.prompt_token_ids` is its
    prompt, so `prompt` may be left out (a failover's batch then carries each prompt's ids once,
    not twice)."""

    prompt: Ids | str | Texts | Annotated[list[Ids], Field(fail_fast=True)] | None = None
    continuation: Continuation


class ContinuedChat(ChatCompletionRequest):
    """A chat completion the router continues: its templated prompt is `continuation.prompt_token_ids`
    (the messages are not rendered again), so `messages` may be left out."""

    messages: list[ChatMessage] | None = Field(default=None, min_length=1, fail_fast=True)
    continuation: Continuation


CONTINUED: dict[type[BaseModel], type[BaseModel]] = {CompletionRequest: ContinuedCompletion,
                                                     ChatCompletionRequest: ContinuedChat}


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None
    prompt_token_ids: list[int] | None = None  # return_token_ids only (streams: first chunk)
    token_ids: list[int] | None = None  # return_token_ids only


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None
    token_ids: list[int] | None = None  # return_token_ids only


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None  # return_token_ids only


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # return_token_ids only


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids only, first chunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "understudy"
    max_model_len: int
    deterministic: bool = False  # batch-invariant engine: the same request gives the same text under any load


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
