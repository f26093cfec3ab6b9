"""Node registry: which engines exist, their role, health and in-flight load.

Invariants:
- A node is keyed by its normalized URL and has exactly one role.
- A node starts in rotation (optimistic); `failure_threshold` consecutive failures (health
  checks or requests that could not reach it) take it out; one success brings it back.
- `in_flight` counts requests this proxy currently has open on the node (least_loaded uses it);
  it never goes negative because it only changes through `track()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

from epd.proxy.config import ROLES, normalize_url

logger = logging.getLogger(__name__)

# Raises (any exception) when the node is not healthy; its message becomes `last_error`.
HealthFn = Callable[["Node"], Awaitable[None]]


@dataclass
class Node:
    url: str
    role: str
    healthy: bool = True
    consecutive_failures: int = 0
    in_flight: int = 0
    last_error: str | None = None
    last_check: float | None = None  # time.time() of the last health check
    added_at: float = 0.0

    def to_dict(self) -> dict:
        return {
            "url": self.url,
            "role": self.role,
            "healthy": self.healthy,
            "consecutive_failures": self.consecutive_failures,
            "in_flight": self.in_flight,
            "last_error": self.last_error,
            "last_check": self.last_check,
        }


class RoleConflict(ValueError):
    pass


class NodeRegistry:
    def __init__(self, failure_threshold: int = 2, health_fn: HealthFn | None = None) -> None:
        self.failure_threshold = failure_threshold
        self.health_fn = health_fn
        self._nodes: dict[str, Node] = {}

    # -- membership

    def add(self, url: str, role: str) -> tuple[Node, bool]:
        """Register a node; idempotent. Returns (node, created)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        url = normalize_url(url)
        node = self._nodes.get(url)
        if node is not None:
            if node.role != role:
                raise RoleConflict(f"{url} is already registered with role {node.role!r}")
            return node, False
        node = Node(url=url, role=role, added_at=time.time())
        self._nodes[url] = node
        logger.info("node added: %s (%s)", url, role)
        return node, True

    def remove(self, url: str) -> bool:
        node = self._nodes.pop(normalize_url(url), None)
        if node is not None:
            logger.info("node removed: %s (%s)", node.url, node.role)
        return node is not None

    def get(self, url: str) -> Node | None:
        return self._nodes.get(normalize_url(url))

    def nodes(self, role: str | None = None) -> list[Node]:
        return [n for n in self._nodes.values() if role is None or n.role == role]

    def healthy(self, role: str) -> list[Node]:
        return [n for n in self._nodes.values() if n.role == role and n.healthy]

    def counts(self) -> dict[str, dict[str, int]]:
        return {
            role: {"healthy": len(self.healthy(role)), "total": len(self.nodes(role))}
            for role in ROLES
        }

    # -- health transitions

    def record_success(self, node: Node) -> None:
        if not node.healthy:
            logger.info("node back in rotation: %s (%s)", node.url, node.role)
        node.consecutive_failures = 0
        node.healthy = True

    def record_failure(self, node: Node, error: str) -> None:
        node.consecutive_failures += 1
        node.last_error = error
        if node.healthy and node.consecutive_failures >= self.failure_threshold:
            node.healthy = False
            logger.warning(
                "node out of rotation after %d failures: %s (%s): %s",
                node.consecutive_failures,
                node.url,
                node.role,
                error,
            )

    @contextlib.contextmanager
    def track(self, node: Node) -> Iterator[Node]:
        """Count one in-flight request on `node` for the duration of the block."""
        node.in_flight += 1
        try:
            yield node
        finally:
            node.in_flight -= 1

    # -- health checks

    async def check(self, node: Node) -> bool:
        if self.health_fn is None:
            return node.healthy
        try:
            await self.health_fn(node)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # any failure (connect, timeout, non-200) counts
            self.record_failure(node, f"health check: {type(e).__name__}: {e}")
            ok = False
        else:
            self.record_success(node)
            ok = True
        node.last_check = time.time()
        return ok

    async def check_all(self) -> None:
        nodes = list(self._nodes.values())
        if nodes:
            await asyncio.gather(*(self.check(n) for n in nodes))

    async def run_health_loop(self, interval_s: float) -> None:
        """Check every node every `interval_s` seconds until cancelled."""
        while True:
            try:
                await self.check_all()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one round must not stop health checking
                logger.exception("health check round failed")
            await asyncio.sleep(interval_s)


def http_health_fn(client, timeout_s: float) -> HealthFn:
    """GET {url}/health with a short timeout; anything but 200 is a failure."""

    async def check(node: Node) -> None:
        r = await client.get(f"{node.url}/health", timeout=timeout_s)
        if r.status_code != 200:
            raise RuntimeError(f"GET /health returned {r.status_code}")

    return check
