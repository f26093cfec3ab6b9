"""Prometheus metrics of the proxy (one CollectorRegistry per app, so apps never share state).

Stages measured at the proxy: encode (its round trip), prefill (PD mode: P's round trip),
time to first token, time per output token, whole request. Stages measured inside the nodes
arrive as an optional `epd_timings` object ({"epd_migration": s, "pd_migration": s,
"queue": s, ...}) in the final response / last stream chunk and are recorded per key;
migration keys also feed `epd_proxy_migrate_seconds{kind}`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from epd.proxy.config import ROLES

_STAGE_KEY = re.compile(r"^[a-z][a-z0-9_]{0,39}$")
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
CONTENT_TYPE = CONTENT_TYPE_LATEST
# epd_timings keys that are migrations: EPD (encoder features) and PD (KV blocks).
_MIGRATION_KEYS = {"epd_migration": "epd", "pd_migration": "pd", "kv_migration": "pd"}


class ProxyMetrics:
    def __init__(
        self,
        healthy_count: Callable[[str], int] | None = None,
        in_flight: Callable[[str], int] | None = None,
    ) -> None:
        r = self.registry = CollectorRegistry()
        self.encode_seconds = Histogram(
            "epd_proxy_encode_seconds",
            "Encode stage round trip seen at the proxy",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.migrate_seconds = Histogram(
            "epd_proxy_migrate_seconds",
            "Migration time reported by the nodes in epd_timings (kind: epd = encoder "
            "features, pd = prefill KV blocks)",
            ["kind"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_seconds = Histogram(
            "epd_proxy_prefill_seconds",
            "Prefill stage round trip seen at the proxy (PD mode: until P's response)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.engine_stage_seconds = Histogram(
            "epd_proxy_engine_stage_seconds",
            "Per-stage time reported by the LLM node in epd_timings",
            ["stage"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "epd_proxy_time_to_first_token_seconds",
            "Time to first token seen at the proxy (streaming requests)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot_seconds = Histogram(
            "epd_proxy_time_per_output_token_seconds",
            "Decode time per output token after the first, seen at the proxy",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.request_seconds = Histogram(
            "epd_proxy_request_seconds",
            "Whole request latency at the proxy",
            ["path"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "epd_proxy_requests",
            "Requests by path (text / image / pd / epd_pd)",
            ["path"],
            registry=r,
        )
        self.errors = Counter("epd_proxy_errors", "Errors by kind", ["kind"], registry=r)
        self.in_flight = Gauge(
            "epd_proxy_node_requests_in_flight",
            "Requests this proxy has open on nodes, by role",
            ["role"],
            registry=r,
        )
        self.nodes_healthy = Gauge(
            "epd_proxy_nodes_healthy", "Healthy nodes by role", ["role"], registry=r
        )
        if healthy_count is not None:
            for role in ROLES:
                self.nodes_healthy.labels(role).set_function(lambda role=role: healthy_count(role))
        if in_flight is not None:
            for role in ROLES:
                self.in_flight.labels(role).set_function(lambda role=role: in_flight(role))

    def record_timings(self, timings: Any) -> None:
        """Record an LLM node's `epd_timings` object; anything malformed is ignored."""
        if not isinstance(timings, Mapping):
            return
        for key, value in timings.items():
            if not isinstance(key, str) or not _STAGE_KEY.match(key):
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                continue
            self.engine_stage_seconds.labels(key).observe(float(value))
            kind = _MIGRATION_KEYS.get(key)
            if kind is not None and value > 0:  # nodes report 0.0 when nothing migrated
                self.migrate_seconds.labels(kind).observe(float(value))

    def render(self) -> bytes:
        return generate_latest(self.registry)
