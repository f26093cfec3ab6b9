"""Wire types: OpenAI request/response models and the EPD messages between processes.

Invariants:
- JSON only: every type here round-trips through `model_dump_json()` / `model_validate_json()`.
- Requests ignore unknown fields (as OpenAI does); the extensions we support are real fields.
- Validation errors carry the parameter's location, so `epd.errors` renders them with an
  OpenAI `param` (`messages[0].content[1]`, `top_logprobs`, ...). Union branches are tagged in
  CamelCase so those tags never show up in `param`.
- Unsupported OpenAI features (tools, penalties, non-text response formats, echo, suffix)
  are refused with a 400 naming the parameter rather than silently ignored.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

DTYPES = ("float32", "bfloat16", "float16")
KV_LAYOUT_KEYS = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size")
SSE_DONE = "data: [DONE]\n\n"


def _fail(model: str, param: str, message: str, code: str = "value_error", value: Any = None):
    """Raise a validation error located at `param` (a model validator's errors have no loc)."""
    err = PydanticCustomError(code, "{msg}", {"msg": message})
    raise ValidationError.from_exception_data(
        model, [InitErrorDetails(type=err, loc=(param,), input=value)]
    )


def _unsupported(message: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_value", "{msg}", {"msg": message})


def _check_ack_address(v: str) -> str:
    host, _, port = v.removeprefix("tcp://").rpartition(":")
    if not v.startswith("tcp://") or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"must look like tcp://host:port, got {v!r}")
    return v


def _check_http_url(v: str) -> str:
    if not v.startswith(("http://", "https://")):
        raise ValueError(f"must be an http(s) base URL, got {v!r}")
    return v.rstrip("/")


HttpBaseURL = Annotated[str, AfterValidator(_check_http_url)]
AckAddress = Annotated[str, AfterValidator(_check_ack_address)]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


# --------------------------------------------------------------------------- content parts


class TextPart(_Wire):
    type: Literal["text"] = "text"
    text: str


class ImageURL(_Wire):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Wire):
    type: Literal["image_url"] = "image_url"
    image_url: ImageURL


def _part_tag(v: Any) -> str | None:
    t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return {"text": "TextPart", "image_url": "ImagePart"}.get(t) if isinstance(t, str) else None


ContentPart = Annotated[
    Annotated[TextPart, Tag("TextPart")] | Annotated[ImagePart, Tag("ImagePart")],
    Discriminator(
        _part_tag,
        custom_error_type="invalid_content_part",
        custom_error_message="unsupported content part type; supported types are 'text' and 'image_url'",
    ),
]
Content = Annotated[
    Annotated[str, Tag("Text")] | Annotated[list[ContentPart], Tag("Parts")],
    Discriminator(
        lambda v: "Text" if isinstance(v, str) else "Parts" if isinstance(v, list) else None,
        custom_error_type="invalid_content",
        custom_error_message="content must be a string or a list of content parts",
    ),
]


class Message(_Wire):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Content | None = None
    name: str | None = None


# ----------------------------------------------------------------------- EPD wire types


class ImageFeatureRef(_Wire):
    """Where one image's features live in an encoder's multimodal cache."""

    mm_hash: str = Field(min_length=1)
    num_tokens: int = Field(gt=0)
    block_ids: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    block_tokens: int = Field(gt=0)
    dtype: Literal["float32", "bfloat16", "float16"]
    hidden_size: int = Field(gt=0)
    grid_thw: list[Annotated[int, Field(gt=0)]] | None = Field(None, min_length=3, max_length=3)
    lease_id: str = Field(min_length=1)
    lease_expires_at: float  # Unix time (time.time()): compared across processes

    @model_validator(mode="after")
    def _blocks_cover_tokens(self) -> ImageFeatureRef:
        need = math.ceil(self.num_tokens / self.block_tokens)
        if len(self.block_ids) != need:
            _fail(
                "ImageFeatureRef",
                "block_ids",
                f"{self.num_tokens} tokens in blocks of {self.block_tokens} need {need} "
                f"blocks, got {len(self.block_ids)}",
                value=self.block_ids,
            )
        return self


class EncoderResult(_Wire):
    encoder_id: str = Field(min_length=1)
    encoder_url: HttpBaseURL  # HTTP base URL: transfer handshake and explicit release
    transfer_backend: str = Field(min_length=1)
    pool_name: str = Field(min_length=1)
    ack_address: AckAddress
    images: list[ImageFeatureRef] = Field(min_length=1)

    @property
    def lease_ids(self) -> list[str]:
        return [img.lease_id for img in self.images]


class EncodeRequest(_Wire):
    content: list[ContentPart] = Field(min_length=1)
    request_id: str | None = None


class EncodeResponse(_Wire):
    encoder_result: EncoderResult


class ReleaseRequest(_Wire):
    lease_ids: list[str] = Field(min_length=1)


class ReleaseResponse(_Wire):
    released: int = Field(ge=0)


class MigrationRequest(_Wire):
    """A finished prefill's KV blocks, for the decode engine to pull (PD migration)."""

    engine_id: str = Field(min_length=1)
    engine_url: HttpBaseURL
    transfer_backend: str = Field(min_length=1)
    pool_name: str = Field(min_length=1)
    ack_address: AckAddress
    lease_id: str = Field(min_length=1)
    block_ids: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    block_size: int = Field(gt=0)
    num_tokens: int = Field(gt=0)  # prompt tokens whose KV is in the blocks
    first_token: int = Field(ge=0)
    first_token_logprob: float | None = None
    kv_layout: dict[str, Any]  # KV_LAYOUT_KEYS; the consumer checks it against its own

    @model_validator(mode="after")
    def _consistent(self) -> MigrationRequest:
        missing = [k for k in KV_LAYOUT_KEYS if k not in self.kv_layout]
        if missing:
            _fail("MigrationRequest", "kv_layout", f"missing keys {missing}", value=self.kv_layout)
        if self.kv_layout["dtype"] not in DTYPES:
            _fail("MigrationRequest", "kv_layout", f"dtype must be one of {DTYPES}")
        for k in KV_LAYOUT_KEYS:
            v = self.kv_layout[k]
            if k != "dtype" and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                _fail("MigrationRequest", "kv_layout", f"{k} must be a positive integer, got {v!r}")
        if self.kv_layout["block_size"] != self.block_size:
            _fail("MigrationRequest", "block_size", "does not match kv_layout.block_size")
        if len(self.block_ids) != math.ceil(self.num_tokens / self.block_size):
            _fail(
                "MigrationRequest",
                "block_ids",
                f"{self.num_tokens} tokens in blocks of {self.block_size} need "
                f"{math.ceil(self.num_tokens / self.block_size)} blocks, got {len(self.block_ids)}",
            )
        return self


def kv_layout_mismatch(expected: Mapping[str, Any], got: Mapping[str, Any]) -> str | None:
    """A readable description of the first KV layout difference, or None if compatible."""
    for k in KV_LAYOUT_KEYS:
        if expected.get(k) != got.get(k):
            return f"kv_layout.{k}: expected {expected.get(k)!r}, got {got.get(k)!r}"
    return None


# ----------------------------------------------------------------------------- requests


class StreamOptions(_Wire):
    include_usage: bool = False


# Fields whose explicit JSON null means "default" (clients send null for unset values).
_NULL_IS_DEFAULT = ("n", "stream", "ignore_eos", "logprobs", "echo", "prefill_only")


class _SamplingRequest(_Wire):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None  # extension: -1 disables
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what torch generators accept
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None  # extension
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # EPD extensions, set by the proxy: PD migration source, and "prefill then hand over".
    migration_request: MigrationRequest | None = None
    prefill_only: bool = False

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in _NULL_IS_DEFAULT)}
        return data

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v is not None and v != -1 and v < 1:
            raise ValueError("must be -1 (disabled) or at least 1")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > 16:
            raise ValueError(f"at most 16 stop sequences are supported, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v: float | None) -> float | None:
        if v:
            raise _unsupported("penalties are not supported; omit it or use 0")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise _unsupported("logit_bias is not supported")
        return v

    def _check_common(self) -> None:
        name = type(self).__name__
        if self.stream_options is not None and not self.stream:
            _fail(name, "stream_options", "is only allowed when stream is true")
        if self.prefill_only and self.migration_request is not None:
            _fail(name, "prefill_only", "cannot be combined with migration_request")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (non-streaming responses always carry usage)."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def logprobs_count(self) -> int | None:
        """None: no logprobs; k >= 0: the sampled token's logprob plus k alternatives."""
        return None

    def sampling_options(self) -> dict[str, Any]:
        """The sampling knobs, normalized across chat and completions (None = engine default)."""
        return {
            "max_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": self.stop_list,
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": self.ignore_eos,
            "n": self.n,
            "logprobs": self.logprobs_count,
        }


class ChatCompletionRequest(_SamplingRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # EPD extension, set by the proxy: one result, or one per encoder when the images were
    # split across encoders; their images, concatenated in order, follow the messages.
    encoder_result: EncoderResult | list[EncoderResult] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        name = "ChatCompletionRequest"
        self._check_common()
        if self.top_logprobs is not None and not self.logprobs:
            _fail(name, "top_logprobs", "requires logprobs to be true", value=self.top_logprobs)
        if self.response_format is not None and self.response_format.get("type") != "text":
            _fail(
                name,
                "response_format",
                "only {'type': 'text'} is supported",
                code="unsupported_value",
                value=self.response_format,
            )
        if self.tools:
            _fail(name, "tools", "tool calling is not supported", code="unsupported_parameter")
        if self.tool_choice not in (None, "none", "auto"):
            _fail(name, "tool_choice", "tool calling is not supported", code="unsupported_value")
        n_encoded = sum(len(r.images) for r in self.encoder_results)
        if self.encoder_result is not None and n_encoded != self.num_images:
            _fail(
                name,
                "encoder_result",
                f"has {n_encoded} images but the messages have {self.num_images}",
            )
        return self

    @property
    def encoder_results(self) -> list[EncoderResult]:
        if self.encoder_result is None:
            return []
        if isinstance(self.encoder_result, list):
            return list(self.encoder_result)
        return [self.encoder_result]

    @property
    def num_images(self) -> int:
        return sum(
            isinstance(p, ImagePart)
            for m in self.messages
            if isinstance(m.content, list)
            for p in m.content
        )

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


PromptInput = Annotated[
    Annotated[str, Tag("Text")] | Annotated[list[Annotated[int, Field(ge=0)]], Tag("Tokens")],
    Discriminator(
        lambda v: "Text" if isinstance(v, str) else "Tokens" if isinstance(v, list) else None,
        custom_error_type="invalid_prompt",
        custom_error_message="prompt must be a string or a list of token ids",
    ),
]


class CompletionRequest(_SamplingRequest):
    prompt: PromptInput
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = Field(None, ge=0, le=5)  # legacy: number of alternatives
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _unwrap_batch(cls, v: Any) -> Any:
        # Accept the one-element batch forms ["text"] and [[ids]]; refuse real batches.
        if isinstance(v, list) and v and isinstance(v[0], str | list):
            if len(v) != 1:
                raise _unsupported("batched prompts are not supported; send one per request")
            return v[0]
        return v

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: str | list[int]) -> str | list[int]:
        if len(v) == 0:
            raise ValueError("must not be empty")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> CompletionRequest:
        name = "CompletionRequest"
        self._check_common()
        if self.echo:
            _fail(name, "echo", "echo is not supported", code="unsupported_value")
        if self.suffix:
            _fail(name, "suffix", "suffix is not supported", code="unsupported_parameter")
        if self.best_of is not None and self.best_of != self.n:
            _fail(name, "best_of", "best_of must equal n", code="unsupported_value")
        return self

    @property
    def logprobs_count(self) -> int | None:
        return self.logprobs


# ---------------------------------------------------------------------------- responses

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


class PrefillResponse(_Wire):
    """A prefill engine's answer to a `prefill_only` request: where the decode engine pulls from."""

    id: str
    migration_request: MigrationRequest
    usage: Usage | None = None


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


def __getattr__(name: str) -> Any:
    # `Ack` is owned by epd.transfer (ZMQ acks); re-exported lazily so importing the
    # protocol never pulls in the transfer stack (dlslime, zmq).
    if name == "Ack":
        from epd.transfer.messages import Ack

        return Ack
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
