"""OpenAI response models (full responses, stream chunks, model list) and SSE helpers.

Invariants:
- A stream is a sequence of `sse(chunk)` events ended by `SSE_DONE`; with
  `stream_options.include_usage` the last chunk before it is `chat_usage_chunk` (no
  choices, only usage).
- Streamed /v1/completions events have the response's shape (`CompletionChunk`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, Field

from epd.protocol._base import _Wire

SSE_DONE = "data: [DONE]\n\n"

FinishReason = Literal["stop", "length", "abort", "error", "tool_calls", "content_filter"]


def new_id(prefix: str = "chatcmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(_Wire):
    cached_tokens: int = 0


class Usage(_Wire):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(
        cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
    ) -> Usage:
        details = (
            None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
        )
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=details,
        )


class TopLogprob(_Wire):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(_Wire):
    content: list[TokenLogprob] | None = None


class ChatCompletionMessage(_Wire):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatCompletionChoice(_Wire):
    index: int = 0
    message: ChatCompletionMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(_Wire):
    id: str = Field(default_factory=new_id)
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage | None = None


class DeltaMessage(_Wire):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Wire):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(_Wire):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(_Wire):
    """Legacy /v1/completions logprobs."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Wire):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(_Wire):
    id: str = Field(default_factory=lambda: new_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class CompletionChunk(CompletionResponse):
    """Streamed /v1/completions events have the response's shape (OpenAI: same object)."""


class ModelCard(_Wire):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "epd"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Wire):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


def chat_chunk(
    request_id: str,
    model: str,
    *,
    index: int = 0,
    role: Literal["assistant"] | None = None,
    content: str | None = None,
    finish_reason: FinishReason | None = None,
    logprobs: ChoiceLogprobs | None = None,
    usage: Usage | None = None,
    created: int | None = None,
) -> ChatCompletionChunk:
    choice = ChatChunkChoice(
        index=index,
        delta=DeltaMessage(role=role, content=content),
        logprobs=logprobs,
        finish_reason=finish_reason,
    )
    return ChatCompletionChunk(
        id=request_id, model=model, choices=[choice], usage=usage, created=created or _now()
    )


def chat_usage_chunk(
    request_id: str, model: str, usage: Usage, *, created: int | None = None
) -> ChatCompletionChunk:
    """The final `stream_options.include_usage` chunk: no choices, only usage."""
    return ChatCompletionChunk(
        id=request_id, model=model, choices=[], usage=usage, created=created or _now()
    )


def completion_chunk(
    request_id: str,
    model: str,
    *,
    index: int = 0,
    text: str = "",
    finish_reason: FinishReason | None = None,
    logprobs: CompletionLogprobs | None = None,
    usage: Usage | None = None,
    created: int | None = None,
) -> CompletionChunk:
    choices = (
        []
        if usage is not None and not text and finish_reason is None
        else [
            CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason)
        ]
    )
    return CompletionChunk(
        id=request_id, model=model, choices=choices, usage=usage, created=created or _now()
    )


def sse(data: BaseModel | Mapping[str, Any]) -> str:
    """One server-sent event: `data: {json}\\n\\n`."""
    if isinstance(data, BaseModel):
        payload = data.model_dump_json()
    else:
        payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"
