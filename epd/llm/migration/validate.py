"""Checking an `encoder_result` against this LLM engine, before anything is allocated.

Never trust it blindly: it names block ids in another process's memory. Checked here
(400 naming `encoder_result.images[k].<field>`, or `encoder_result[r].images[k]...` for
a list): token counts equal the processor's per-image count, dtype and hidden size equal
the LLM's, the block count covers the tokens, and the image fits the LLM-side feature
pool. Block ids against the encoder's pool size are checked by `pool_check` once the
handshake has told us that size (`epd.llm.migration.epd_migration`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from epd.errors import EPDError, invalid_request
from epd.transfer import PoolInfo

DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class EPDImage:
    """One image of an EPD request: where its features live on which encoder."""

    ref: Any  # epd.protocol.ImageFeatureRef
    result: Any  # the epd.protocol.EncoderResult holding it
    param: str  # e.g. "encoder_result.images[0]"


@dataclass(frozen=True)
class EPDRequest:
    images: tuple[EPDImage, ...]

    @property
    def lease_ids(self) -> list[str]:
        return [img.ref.lease_id for img in self.images]


def check_encoder_results(
    results: list[Any],
    *,
    listed: bool,
    hidden_size: int,
    dtype: str,
    image_tokens: int | None,
    mm_block_tokens: int,
    mm_num_blocks: int,
) -> EPDRequest:
    """The images of `results` (in order) or an EPDError 400 naming the bad field."""
    images: list[EPDImage] = []
    total_blocks = 0
    for r, result in enumerate(results):
        base = f"encoder_result[{r}]" if listed else "encoder_result"
        for k, ref in enumerate(result.images):
            param = f"{base}.images[{k}]"
            if ref.hidden_size != hidden_size:
                raise invalid_request(
                    f"image features have hidden size {ref.hidden_size}; this model's is "
                    f"{hidden_size}", f"{param}.hidden_size", "encoder_result_mismatch")
            if ref.dtype != dtype:
                raise invalid_request(
                    f"image features are {ref.dtype}; this engine computes in {dtype} (start "
                    "the encoder with a matching --dtype)", f"{param}.dtype",
                    "encoder_result_mismatch")
            if image_tokens is not None and ref.num_tokens != image_tokens:
                raise invalid_request(
                    f"the image has {ref.num_tokens} feature rows; this model's processor "
                    f"expands an image to {image_tokens} placeholder tokens",
                    f"{param}.num_tokens", "encoder_result_mismatch")
            if len(ref.block_ids) != -(-ref.num_tokens // ref.block_tokens):
                raise invalid_request(
                    f"{len(ref.block_ids)} block ids do not cover {ref.num_tokens} tokens in "
                    f"blocks of {ref.block_tokens}", f"{param}.block_ids")
            total_blocks += -(-ref.num_tokens // mm_block_tokens)
            images.append(EPDImage(ref, result, param))
    if total_blocks > mm_num_blocks:
        raise invalid_request(
            f"the images need {total_blocks} feature blocks of {mm_block_tokens} tokens; this "
            f"engine's feature pool has {mm_num_blocks} (raise --mm-num-blocks / "
            "--mm-cache-memory)", "encoder_result", "image_too_large_for_cache")
    return EPDRequest(tuple(images))


def pool_check(images: list[EPDImage], dtype: str) -> Any:
    """A `MigrationJob.check`: these images' blocks against the encoder's pool info."""

    def check(pool: PoolInfo) -> EPDError | None:
        if pool.dtype != dtype:
            return invalid_request(
                f"the encoder's feature pool is {pool.dtype}, this engine's {dtype}",
                f"{images[0].param}.dtype", "encoder_result_mismatch")
        for img in images:
            ref = img.ref
            expected = ref.block_tokens * ref.hidden_size * DTYPE_SIZES[ref.dtype]
            if pool.block_nbytes != expected:
                return invalid_request(
                    f"block_tokens {ref.block_tokens} does not match the encoder's pool "
                    f"({pool.block_nbytes} bytes per block)", f"{img.param}.block_tokens",
                    "encoder_result_mismatch")
            bad = [b for b in ref.block_ids if b >= pool.num_blocks]
            if bad:
                return invalid_request(
                    f"block id {bad[0]} is out of range: the encoder's pool has "
                    f"{pool.num_blocks} blocks", f"{img.param}.block_ids",
                    "encoder_result_mismatch")
        return None

    return check


def epd_prompt(processor: Any, messages: list[dict], epd: EPDRequest) -> tuple[list[int], list]:
    """The chat prompt's token ids with each image placeholder expanded to its encoded
    token count, and one `MMItem` (keyed by the encoder's mm_hash) per image. Raises
    ValueError when the placeholders and the images disagree."""
    from epd.llm.sequence import MMItem

    counts = [SimpleNamespace(num_tokens=img.ref.num_tokens) for img in epd.images]
    prompt = processor.tokenize(processor.render(messages), counts)
    items = [
        MMItem(offset=span.offset, length=span.length, mm_hash=img.ref.mm_hash)
        for span, img in zip(prompt.mm_spans, epd.images, strict=True)
    ]
    return list(prompt.token_ids), items
