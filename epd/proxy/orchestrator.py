"""E -> LLM orchestration: find a request's images, encode them (split across encoders in
parallel, order preserved), and release the encoder leases when the request fails.

Invariants:
- Images are split into contiguous, balanced chunks, one chunk per chosen encoder; the
  chunks' `encoder_result`s, concatenated in chunk order, list the images in the order they
  appear in the messages (the order the LLM engine consumes them).
- Every lease the encoders granted for a request is either handed to the LLM node (which
  acks it) or released here (POST /v1/encode/release) when the request fails; releases are
  idempotent on the encoder, so releasing after a partial failure is always safe.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from epd.errors import service_unavailable, upstream_error
from epd.proxy.metrics import ProxyMetrics
from epd.proxy.registry import Node, NodeRegistry
from epd.proxy.relay import passthrough
from epd.proxy.routing import Router

logger = logging.getLogger(__name__)

_CONTENT_PARAM = re.compile(r"^content\[(\d+)\](.*)$")


@dataclass(frozen=True)
class ImageSlot:
    param: str  # where the part is in the client's request: messages[i].content[j]
    part: dict[str, Any]  # the image_url content part, forwarded unchanged


def collect_images(body: dict[str, Any]) -> list[ImageSlot]:
    """The image_url parts of a chat body, in order of appearance (malformed parts are
    left for the LLM node to reject)."""
    slots: list[ImageSlot] = []
    messages = body.get("messages")
    if not isinstance(messages, list):
        return slots
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                slots.append(ImageSlot(f"messages[{i}].content[{j}]", part))
    return slots


def split_evenly(n_items: int, n_groups: int) -> list[range]:
    """Contiguous, balanced, order-preserving chunks; never an empty chunk."""
    n_groups = max(1, min(n_groups, n_items))
    base, extra = divmod(n_items, n_groups)
    out, start = [], 0
    for g in range(n_groups):
        size = base + (1 if g < extra else 0)
        out.append(range(start, start + size))
        start += size
    return [r for r in out if len(r)]


@dataclass
class Encoded:
    """The encoder results of one request, in image order, and who holds which leases."""

    results: list[dict[str, Any]] = field(default_factory=list)
    leases: list[tuple[str, list[str]]] = field(default_factory=list)  # (node url, lease ids)

    def attach_to(self, body: dict[str, Any]) -> dict[str, Any]:
        out = dict(body)
        # One encoder: the plain object; several: a list whose images concatenate in order.
        out["encoder_result"] = self.results[0] if len(self.results) == 1 else self.results
        return out


def remap_param(err: dict[str, Any], chunk: Sequence[ImageSlot]) -> dict[str, Any]:
    """Rewrite an encoder error's `content[j]...` param to the client's `messages[i].content[k]`."""
    inner = err.get("error") if isinstance(err, dict) else None
    if not isinstance(inner, dict) or not isinstance(inner.get("param"), str):
        return err
    m = _CONTENT_PARAM.match(inner["param"])
    if m and int(m.group(1)) < len(chunk):
        inner = {**inner, "param": chunk[int(m.group(1))].param + m.group(2)}
        return {**err, "error": inner}
    return err


class EncodeStage:
    def __init__(
        self,
        client: httpx.AsyncClient,
        registry: NodeRegistry,
        router: Router,
        metrics: ProxyMetrics,
        timeout: httpx.Timeout,
    ) -> None:
        self.client = client
        self.registry = registry
        self.router = router
        self.metrics = metrics
        self.timeout = timeout

    async def encode(self, slots: Sequence[ImageSlot]) -> Encoded:
        encoders = self.registry.healthy("encoder")
        chosen = self.router.choose_many(encoders, len(slots))
        if not chosen:
            raise service_unavailable("No healthy encoder node is available.", retry_after_s=1)
        chunks = split_evenly(len(slots), len(chosen))
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(
            *(
                self._encode_chunk(node, [slots[i] for i in r])
                for node, r in zip(chosen, chunks, strict=True)
            ),
            return_exceptions=True,
        )
        encoded = Encoded()
        first_error: BaseException | None = None
        for node, outcome in zip(chosen, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                first_error = first_error or outcome
                continue
            encoded.results.append(outcome)
            leases = [img.get("lease_id") for img in outcome.get("images", [])]
            encoded.leases.append((node.url, [x for x in leases if isinstance(x, str)]))
        if first_error is not None:
            await self.release(encoded)
            self.metrics.errors.labels("encode_failed").inc()
            raise first_error
        self.metrics.encode_seconds.observe(time.perf_counter() - t0)
        return encoded

    async def _encode_chunk(self, node: Node, chunk: list[ImageSlot]) -> dict[str, Any]:
        with self.registry.track(node):
            try:
                r = await self.client.post(
                    f"{node.url}/v1/encode",
                    json={"content": [s.part for s in chunk]},
                    timeout=self.timeout,
                )
            except httpx.HTTPError as e:
                self.registry.record_failure(node, f"encode: {type(e).__name__}: {e}")
                raise upstream_error(
                    f"encode stage failed: encoder {node.url} unreachable ({type(e).__name__})",
                    "encode_failed",
                ) from e
        if r.status_code == 200:
            try:
                result = r.json()["encoder_result"]
                if len(result["images"]) != len(chunk):
                    raise ValueError(f"{len(result['images'])} images for {len(chunk)} sent")
            except (ValueError, KeyError, TypeError) as e:
                self.registry.record_failure(node, f"encode: malformed response: {e}")
                raise upstream_error(
                    f"encode stage failed: encoder {node.url} sent a malformed response ({e})",
                    "encode_failed",
                ) from e
            self.registry.record_success(node)
            return result
        if 400 <= r.status_code < 500 or r.status_code == 503:
            # The client's fault (bad image) or backpressure: the client sees it as is,
            # with the param pointing into its own request.
            raise passthrough(r, remap=lambda body: remap_param(body, chunk))
        self.registry.record_failure(node, f"encode: HTTP {r.status_code}")
        raise upstream_error(
            f"encode stage failed: encoder {node.url} returned HTTP {r.status_code}",
            "encode_failed",
        )

    async def release(self, encoded: Encoded) -> None:
        """Best effort: an unreachable encoder frees the leases itself when they expire."""
        calls = [self._release_one(url, ids) for url, ids in encoded.leases if ids]
        if calls:
            await asyncio.gather(*calls)
        encoded.leases = []

    async def _release_one(self, url: str, lease_ids: list[str]) -> None:
        try:
            r = await self.client.post(
                f"{url}/v1/encode/release", json={"lease_ids": lease_ids}, timeout=5.0
            )
            if r.status_code != 200:
                logger.warning("release at %s returned HTTP %d", url, r.status_code)
        except httpx.HTTPError as e:
            logger.warning("release at %s failed (%s); leases expire on their own", url, e)
