"""EPD wire types: the messages between encoder, LLM engines and proxy (not OpenAI's).

Invariants:
- JSON only: every type round-trips through `model_dump_json()` / `model_validate_json()`.
- Block ids, never tensors, cross process boundaries; a ref's `block_ids` cover exactly
  `ceil(num_tokens / block_tokens)` blocks (checked here).
- `lease_expires_at` is Unix time (`time.time()`), comparable across processes.
- `MigrationRequest.kv_layout` carries every key of `KV_LAYOUT_KEYS` (checked here); the
  consumer compares it with its own layout through `kv_layout_mismatch`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator

from epd.protocol._base import DTYPES, KV_LAYOUT_KEYS, _fail, _Wire
from epd.protocol.content import ContentPart
from epd.protocol.responses import Usage


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


class MMSpanRef(_Wire):
    """An image's placeholder span in a migrated prompt (the decode engine has no image)."""

    offset: int = Field(ge=0)
    length: int = Field(gt=0)
    mm_hash: str = Field(min_length=1)


class MigrationRequest(_Wire):
    """A finished prefill's KV blocks, for the decode engine to pull (PD migration).

    `block_ids[i]` holds prompt tokens `[i * block_size, (i + 1) * block_size)`. The
    optional `prompt_token_ids` / `mm_spans` describe the prompt the prefill computed, so
    the decode engine can check that the client's body gives the same prompt and place
    image spans without the images; `first_token_top_logprobs` are `[token id, logprob]`
    pairs when the request asked for top logprobs.
    """

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
    first_token_top_logprobs: list[tuple[int, float]] = Field(default_factory=list)
    prompt_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    mm_spans: list[MMSpanRef] = Field(default_factory=list)
    num_cached_tokens: int = Field(0, ge=0)  # prefix-cache hit on the prefill side
    lease_expires_at: float | None = None  # Unix time

    @model_validator(mode="after")
    def _consistent(self) -> MigrationRequest:
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.num_tokens:
            _fail("MigrationRequest", "prompt_token_ids",
                  f"has {len(self.prompt_token_ids)} ids, num_tokens is {self.num_tokens}")
        for span in self.mm_spans:
            if span.offset + span.length > self.num_tokens:
                _fail("MigrationRequest", "mm_spans", "an image span lies outside the prompt")
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


class PrefillResponse(_Wire):
    """A prefill engine's answer to a `prefill_only` request: where the decode engine pulls from."""

    id: str
    migration_request: MigrationRequest
    usage: Usage | None = None
