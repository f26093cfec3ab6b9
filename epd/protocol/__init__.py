"""Wire types: OpenAI request/response models and the EPD messages between processes.

Invariants:
- JSON only: every type here round-trips through `model_dump_json()` / `model_validate_json()`.
- Requests ignore unknown fields (as OpenAI does); the extensions we support are real fields.
- Validation errors carry the parameter's location, so `epd.errors` renders them with an
  OpenAI `param`.

Modules: `content` (message parts), `requests` (OpenAI requests), `responses` (OpenAI
responses, stream chunks, SSE helpers), `wire` (EPD types: `EncoderResult`,
`MigrationRequest`, ...). Import from `epd.protocol`; the split is an implementation detail.
`Ack` is owned by `epd.transfer.messages` and re-exported lazily, so importing the protocol
never pulls in the transfer stack (dlslime, zmq).
"""

from __future__ import annotations

from typing import Any

from epd.protocol._base import DTYPES, KV_LAYOUT_KEYS
from epd.protocol.content import Content, ContentPart, ImagePart, ImageURL, Message, TextPart
from epd.protocol.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    PromptInput,
    StreamOptions,
)
from epd.protocol.responses import (
    SSE_DONE,
    ChatChunkChoice,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionResponse,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    FinishReason,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
    chat_chunk,
    chat_usage_chunk,
    completion_chunk,
    new_id,
    sse,
)
from epd.protocol.wire import (
    AckAddress,
    EncodeRequest,
    EncodeResponse,
    EncoderResult,
    HttpBaseURL,
    ImageFeatureRef,
    MigrationRequest,
    MMSpanRef,
    PrefillResponse,
    ReleaseRequest,
    ReleaseResponse,
    kv_layout_mismatch,
)

__all__ = [
    "DTYPES",
    "KV_LAYOUT_KEYS",
    "SSE_DONE",
    "Ack",
    "AckAddress",
    "ChatChunkChoice",
    "ChatCompletionChoice",
    "ChatCompletionChunk",
    "ChatCompletionMessage",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChoiceLogprobs",
    "CompletionChoice",
    "CompletionChunk",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "Content",
    "ContentPart",
    "DeltaMessage",
    "EncodeRequest",
    "EncodeResponse",
    "EncoderResult",
    "FinishReason",
    "HttpBaseURL",
    "ImageFeatureRef",
    "ImagePart",
    "ImageURL",
    "Message",
    "MigrationRequest",
    "MMSpanRef",
    "ModelCard",
    "ModelList",
    "PrefillResponse",
    "PromptInput",
    "PromptTokensDetails",
    "ReleaseRequest",
    "ReleaseResponse",
    "StreamOptions",
    "TextPart",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "chat_chunk",
    "chat_usage_chunk",
    "completion_chunk",
    "kv_layout_mismatch",
    "new_id",
    "sse",
]


def __getattr__(name: str) -> Any:
    if name == "Ack":
        from epd.transfer.messages import Ack

        return Ack
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
