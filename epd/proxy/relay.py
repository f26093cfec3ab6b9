"""Relay a request to an LLM node and its answer back to the client, streaming or not.

Invariants:
- SSE bytes are passed through as they arrive; 4xx (and 503) answers of a node reach the
  client unchanged (status + OpenAI error body).
- Every exit that is not a complete answer (node unreachable, 5xx, broken stream, client
  disconnect) runs `on_failure` exactly once (it releases the encoder leases).
- A client disconnect closes the upstream connection, so the node aborts the sequence and
  frees its blocks; the upstream response is always closed, and the node's in-flight count
  always restored, even when the client vanishes before the stream starts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from epd.errors import EPDError, error_body, error_response, upstream_error
from epd.protocol import SSE_DONE, sse
from epd.proxy.metrics import ProxyMetrics
from epd.proxy.registry import Node, NodeRegistry

logger = logging.getLogger(__name__)

OnFailure = Callable[[], Awaitable[None]]
_KEEP_HEADERS = ("content-type", "retry-after")
_DISCONNECT_POLL_S = 0.25


class PassThrough(Exception):
    """A node's answer that goes to the client unchanged (its 4xx, or a 503 with Retry-After)."""

    def __init__(self, status: int, content: bytes, headers: dict[str, str]) -> None:
        super().__init__(f"upstream HTTP {status}")
        self.status_code = status
        self.content = content
        self.headers = headers

    def response(self) -> Response:
        return Response(self.content, status_code=self.status_code, headers=self.headers)


def passthrough(r: httpx.Response, remap: Callable[[Any], Any] | None = None) -> PassThrough:
    content = r.content
    if remap is not None:
        try:
            content = json.dumps(remap(json.loads(content))).encode()
        except ValueError:
            pass
    headers = {k: r.headers[k] for k in _KEEP_HEADERS if k in r.headers}
    return PassThrough(r.status_code, content, headers)


class _RelayResponse(StreamingResponse):
    """A StreamingResponse that always runs `cleanup`, even if the body never started."""

    def __init__(self, content: AsyncIterator[bytes], cleanup: Callable[[], Awaitable[None]]):
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._cleanup()


class _StreamStats:
    """Scans SSE lines for metrics without altering them."""

    def __init__(self) -> None:
        self.buf = b""
        self.first_token_t: float | None = None
        self.last_token_t: float | None = None
        self.content_chunks = 0
        self.completion_tokens: int | None = None
        self.timings: Any = None
        self.done = False
        self.ends_clean = True  # the bytes so far end on an event boundary (or none yet)

    def feed(self, chunk: bytes) -> None:
        self.ends_clean = chunk.endswith(b"\n\n")
        self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        for line in lines:
            self._line(line.strip())

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            return
        if not isinstance(obj, dict):
            return
        for choice in obj.get("choices") or []:
            delta = choice.get("delta") if isinstance(choice, dict) else None
            text = (delta or {}).get("content") if isinstance(delta, dict) else choice.get("text")
            if text:
                now = time.perf_counter()
                self.first_token_t = self.first_token_t or now
                self.last_token_t = now
                self.content_chunks += 1
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.completion_tokens = usage["completion_tokens"]
        if obj.get("epd_timings") is not None:
            self.timings = obj["epd_timings"]


class Relay:
    def __init__(
        self,
        client: httpx.AsyncClient,
        registry: NodeRegistry,
        metrics: ProxyMetrics,
        timeout: httpx.Timeout,
    ) -> None:
        self.client = client
        self.registry = registry
        self.metrics = metrics
        self.timeout = timeout

    def _node_failed(self, node: Node, stage: str, why: str) -> EPDError:
        self.registry.record_failure(node, f"{stage}: {why}")
        self.metrics.errors.labels(f"{stage}_failed").inc()
        return upstream_error(f"{stage} stage failed: {node.url}: {why}", f"{stage}_failed")

    async def forward(
        self,
        request: Request,
        node: Node,
        path: str,
        body: dict[str, Any],
        *,
        stage: str,
        label: str,
        on_failure: OnFailure,
        t0: float,
    ) -> Response:
        """POST `body` to `node.url + path`; `stage` names the node's stage in errors,
        `label` the request path (text / image / pd) in metrics."""
        req = self.client.build_request("POST", node.url + path, json=body, timeout=self.timeout)
        stream = bool(body.get("stream"))
        node.in_flight += 1
        try:
            resp = await self.send_watching(request, req, stream)
        except BaseException as e:
            node.in_flight -= 1
            await _shielded(on_failure)
            if isinstance(e, ClientGone):
                self.metrics.errors.labels("client_disconnect").inc()
                return Response(status_code=499)
            if isinstance(e, httpx.HTTPError):
                return error_response(self._node_failed(node, stage, f"{type(e).__name__}: {e}"))
            raise
        if resp.status_code != 200 or not stream:
            try:
                await resp.aread()
            except httpx.HTTPError as e:
                await _shielded(on_failure)
                return error_response(self._node_failed(node, stage, f"{type(e).__name__}: {e}"))
            finally:
                node.in_flight -= 1
                await resp.aclose()
            return await self._finish_plain(node, stage, label, resp, on_failure, t0)
        return self._stream(node, stage, label, resp, on_failure, t0)

    async def send_watching(
        self, request: Request, req: httpx.Request, stream: bool
    ) -> httpx.Response:
        """Send, but give up (closing the connection) if the client goes away meanwhile."""
        task = asyncio.ensure_future(self.client.send(req, stream=True))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if done:
                    resp = task.result()
                    if stream:
                        return resp
                    # Non-streaming: the body arrives when generation ends; keep watching.
                    read = asyncio.ensure_future(resp.aread())
                    try:
                        while not (await asyncio.wait({read}, timeout=_DISCONNECT_POLL_S))[0]:
                            if await request.is_disconnected():
                                raise ClientGone
                        read.result()
                    except BaseException:
                        read.cancel()
                        await resp.aclose()
                        raise
                    return resp
                if await request.is_disconnected():
                    raise ClientGone
        except BaseException:
            if not task.done():
                task.cancel()
            raise

    async def _finish_plain(
        self,
        node: Node,
        stage: str,
        label: str,
        resp: httpx.Response,
        on_failure: OnFailure,
        t0: float,
    ) -> Response:
        if resp.status_code == 200:
            self.registry.record_success(node)
            try:
                obj = resp.json()
                self.metrics.record_timings(obj.get("epd_timings"))
            except (ValueError, AttributeError):
                pass
            self.metrics.request_seconds.labels(label).observe(time.perf_counter() - t0)
            headers = {k: resp.headers[k] for k in _KEEP_HEADERS if k in resp.headers}
            return Response(resp.content, status_code=200, headers=headers)
        await _shielded(on_failure)
        if 400 <= resp.status_code < 500 or resp.status_code == 503:
            self.metrics.errors.labels(f"upstream_{resp.status_code}").inc()
            return passthrough(resp).response()
        detail = resp.text[:300]
        return error_response(self._node_failed(node, stage, f"HTTP {resp.status_code}: {detail}"))

    def _stream(
        self,
        node: Node,
        stage: str,
        label: str,
        resp: httpx.Response,
        on_failure: OnFailure,
        t0: float,
    ) -> Response:
        stats = _StreamStats()
        state = {"closed": False, "ok": False}

        async def cleanup() -> None:
            if state["closed"]:
                return
            state["closed"] = True
            node.in_flight -= 1
            await resp.aclose()
            if not state["ok"]:
                self.metrics.errors.labels("client_disconnect").inc()
                await on_failure()

        async def events() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_bytes():
                    stats.feed(chunk)
                    yield chunk
                if not stats.done:
                    raise httpx.RemoteProtocolError("stream ended before [DONE]")
            except httpx.HTTPError as e:
                state["ok"] = True  # handled here: not a client disconnect
                err = self._node_failed(node, stage, f"broken stream: {type(e).__name__}: {e}")
                with anyio.CancelScope(shield=True):
                    await on_failure()
                prefix = b"" if stats.ends_clean else b"\n\n"
                yield prefix + sse(error_body(err)).encode() + SSE_DONE.encode()
                return
            state["ok"] = True
            self.registry.record_success(node)
            self._record_stream(stats, label, t0)

        return _RelayResponse(events(), cleanup)

    def _record_stream(self, stats: _StreamStats, label: str, t0: float) -> None:
        m = self.metrics
        if stats.first_token_t is not None:
            m.ttft_seconds.observe(stats.first_token_t - t0)
            n = stats.completion_tokens or stats.content_chunks
            if n > 1 and stats.last_token_t is not None:
                m.tpot_seconds.observe((stats.last_token_t - stats.first_token_t) / (n - 1))
        m.record_timings(stats.timings)
        m.request_seconds.labels(label).observe(time.perf_counter() - t0)


class ClientGone(Exception):
    pass


async def _shielded(fn: Callable[[], Awaitable[None]]) -> None:
    """Run cleanup even while the surrounding task is being cancelled."""
    with anyio.CancelScope(shield=True):
        await fn()
