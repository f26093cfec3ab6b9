"""OpenAI request models: /v1/chat/completions and /v1/completions.

Invariants:
- Requests ignore unknown fields (as OpenAI does); the extensions we support are real fields
  (`top_k`, `stop_token_ids`, `ignore_eos`, and the proxy-set `encoder_result`,
  `migration_request`, `prefill_only`).
- Validation errors carry the parameter's location, so `epd.errors` renders them with an
  OpenAI `param` (`messages[0].content[1]`, `top_logprobs`, ...).
- Unsupported OpenAI features (tools, penalties, non-text response formats, echo, suffix)
  are refused with a 400 naming the parameter rather than silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from epd.protocol._base import _fail, _unsupported, _Wire
from epd.protocol.content import ImagePart, Message
from epd.protocol.wire import EncoderResult, MigrationRequest


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
