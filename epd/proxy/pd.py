"""Prefill-decode disaggregation at the proxy: [E ->] P -> D.

A request goes to a prefill node with `"prefill_only": true, "stream": false` (plus the
`encoder_result` for image requests); P answers a PrefillResponse whose `migration_request`
names the KV blocks it holds under a lease. The client's original body plus that
`migration_request` then goes to a decode node, whose answer (JSON or SSE, first token =
the prefill's) is relayed to the client. The prefill response is never shown to the client.

Invariants:
- Encoder leases are released here when the prefill stage fails (P never consumed them);
  once P answered 200 it has migrated the features and acked the encoder itself.
- P's KV lease is released (POST {P}/v1/prefill/release) on every exit from the decode
  stage that is not a complete answer; after D's migration the lease is already ended, and
  the release is an idempotent no-op on P. A P that cannot be reached frees it at expiry.
- Errors: P unreachable or 5xx -> 502 code `prefill_failed`; D unreachable, 5xx or a broken
  stream -> 502 code `decode_failed` (a broken stream: an error chunk then [DONE]); 4xx and
  503 answers of P or D reach the client unchanged. `n > 1` is refused up front (400, `n`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response

from epd.errors import EPDError, invalid_request, upstream_error
from epd.proxy.metrics import ProxyMetrics
from epd.proxy.orchestrator import Encoded, EncodeStage
from epd.proxy.registry import Node, NodeRegistry
from epd.proxy.relay import Relay, passthrough

logger = logging.getLogger(__name__)

RELEASE_PATH = "/v1/prefill/release"


def check_pd_body(body: dict[str, Any]) -> None:
    """What PD mode cannot serve, refused before any node is touched."""
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        raise invalid_request(
            "n > 1 is not supported in prefill-decode mode; send n separate requests.", "n"
        )


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The body P gets: the client's (with encoder_result when attached), prefill only,
    never streamed (stream_options is only valid with stream)."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    out["prefill_only"] = True
    out["stream"] = False
    return out


def decode_body(body: dict[str, Any], migration_request: dict[str, Any]) -> dict[str, Any]:
    """The body D gets: the client's original body plus the migration source."""
    out = {k: v for k, v in body.items() if k != "encoder_result"}
    out["migration_request"] = migration_request
    return out


class PDFlow:
    def __init__(
        self,
        client: httpx.AsyncClient,
        registry: NodeRegistry,
        metrics: ProxyMetrics,
        relay: Relay,
        encode_stage: EncodeStage,
        timeout: httpx.Timeout,
    ) -> None:
        self.client = client
        self.registry = registry
        self.metrics = metrics
        self.relay = relay
        self.encode_stage = encode_stage
        self.timeout = timeout

    async def run(
        self,
        request: Request,
        prefill: Node,
        decode: Node,
        path: str,
        body: dict[str, Any],
        encoded: Encoded,
        *,
        label: str,
        t0: float,
    ) -> Response:
        """`encoded` holds the encoder results already attached to `body` (or nothing)."""
        try:
            migration = await self._prefill(request, prefill, path, body)
        except BaseException:
            await self.encode_stage.release(encoded)
            raise
        lease_id = migration.get("lease_id")
        clean = {k: v for k, v in body.items() if k != "encoder_result"}

        async def release_prefill() -> None:
            if isinstance(lease_id, str):
                await self.release(prefill.url, [lease_id])

        return await self.relay.forward(
            request,
            decode,
            path,
            decode_body(clean, migration),
            stage="decode",
            label=label,
            on_failure=release_prefill,
            t0=t0,
        )

    async def _prefill(
        self, request: Request, node: Node, path: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        """P's `migration_request`; raises EPDError, PassThrough or relay.ClientGone."""
        req = self.client.build_request(
            "POST", node.url + path, json=prefill_body(body), timeout=self.timeout
        )
        t = time.perf_counter()
        with self.registry.track(node):
            try:
                resp = await self.relay.send_watching(request, req, stream=False)
            except httpx.HTTPError as e:
                raise self._failed(node, f"{type(e).__name__}: {e}") from e
        try:
            if 400 <= resp.status_code < 500 or resp.status_code == 503:
                self.metrics.errors.labels(f"upstream_{resp.status_code}").inc()
                raise passthrough(resp)
            if resp.status_code != 200:
                raise self._failed(node, f"HTTP {resp.status_code}: {resp.text[:300]}")
            try:
                obj = resp.json()
                migration = obj["migration_request"]
                if not isinstance(migration, dict) or not isinstance(migration["lease_id"], str):
                    raise TypeError("migration_request.lease_id missing")
            except (ValueError, KeyError, TypeError) as e:
                raise self._failed(node, f"malformed prefill response ({e})") from e
        finally:
            await resp.aclose()
        self.registry.record_success(node)
        self.metrics.prefill_seconds.observe(time.perf_counter() - t)
        self.metrics.record_timings(obj.get("epd_timings"))
        return migration

    def _failed(self, node: Node, why: str) -> EPDError:
        self.registry.record_failure(node, f"prefill: {why}")
        self.metrics.errors.labels("prefill_failed").inc()
        return upstream_error(f"prefill stage failed: {node.url}: {why}", "prefill_failed")

    async def release(self, url: str, lease_ids: list[str]) -> None:
        """Best effort: an unreachable P frees the blocks itself when the lease expires."""
        try:
            r = await self.client.post(
                f"{url}{RELEASE_PATH}", json={"lease_ids": lease_ids}, timeout=5.0
            )
            if r.status_code != 200:
                logger.warning("prefill release at %s returned HTTP %d", url, r.status_code)
        except httpx.HTTPError as e:
            logger.warning("prefill release at %s failed (%s); the lease expires", url, e)
