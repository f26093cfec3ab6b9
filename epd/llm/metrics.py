"""Prometheus metrics of the LLM server (`GET /metrics`).

Invariants:
- Each server owns its own `CollectorRegistry` (several servers may live in one test
  process); nothing registers in prometheus_client's global registry.
- Gauges that mirror engine state (running/waiting sequences, KV blocks) are read from
  `engine.stats()` at scrape time, so they are never stale.
- Counters and histograms are fed by the serving layer through `RequestTracker`: one per
  request, `finish()` is idempotent so a request is counted exactly once.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "epd"
TOKENS_PER_S_WINDOW_S = 10.0
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

# metric name -> EngineStats attribute read at scrape time
_ENGINE_GAUGES = {
    "num_requests_running": ("num_running", "Sequences being prefilled or decoded."),
    "num_requests_waiting": ("num_waiting", "Sequences waiting to be scheduled."),
    "kv_blocks_total": ("kv_blocks_total", "KV cache blocks in the pool."),
    "kv_blocks_used": ("kv_blocks_used", "KV cache blocks held by sequences or the prefix cache."),
    "kv_blocks_free": ("kv_blocks_free", "KV cache blocks free for allocation."),
    "pd_leases_active": ("pd_leases_active", "Prefill role: KV hand-overs still leased."),
    "pd_num_migrating": ("pd_num_migrating", "Decode role: KV migrations in progress."),
}
# PD counters (metric name without _total -> EngineStats attribute), read at scrape time.
_PD_COUNTERS = {
    "pd_handovers": ("pd_handovers", "Prefill role: prefills handed over to decode engines."),
    "pd_leases_expired": ("pd_leases_expired", "Prefill role: KV leases ended by expiry."),
    "pd_migrations": ("pd_migrations", "Decode role: KV migrations completed."),
    "pd_migrations_failed": ("pd_migrations_failed", "Decode role: KV migrations failed."),
    "pd_migration_bytes": ("pd_migration_bytes", "Decode role: KV bytes pulled."),
}


class _EngineCollector:
    def __init__(self, stats_fn: Callable[[], Any], tokens_per_s: Callable[[], float]) -> None:
        self._stats_fn = stats_fn
        self._tokens_per_s = tokens_per_s

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            stats = self._stats_fn()
        except Exception:  # a dead engine must not break the scrape
            stats = None
        for name, (attr, doc) in _ENGINE_GAUGES.items():
            value = getattr(stats, attr, None) if stats is not None else None
            if value is not None:
                yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=float(value))
        if stats is not None:
            yield from _pd_metrics(stats)
        yield GaugeMetricFamily(
            f"{PREFIX}_generation_tokens_per_second",
            f"Output tokens per second over the last {TOKENS_PER_S_WINDOW_S:.0f} s.",
            value=self._tokens_per_s(),
        )


def _pd_metrics(stats: Any) -> Iterator[Any]:
    from epd.llm.pd.consumer import LATENCY_BUCKETS

    for name, (attr, doc) in _PD_COUNTERS.items():
        yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=float(getattr(stats, attr, 0)))
    counts = tuple(getattr(stats, "pd_migration_seconds_buckets", ()) or ())
    if len(counts) == len(LATENCY_BUCKETS):
        buckets = [(str(b), float(c)) for b, c in zip(LATENCY_BUCKETS, counts, strict=True)]
        buckets.append(("+Inf", float(stats.pd_migrations)))
        yield HistogramMetricFamily(
            f"{PREFIX}_pd_migration_seconds", "Decode role: KV migration latency (submit to "
            "read complete).", buckets=buckets, sum_value=stats.pd_migration_seconds_sum)


class ServerMetrics:
    def __init__(self, stats_fn: Callable[[], Any]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of admitted requests.", registry=r
        )
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens", "Generated (output) tokens.", registry=r
        )
        self.requests = Counter(
            f"{PREFIX}_requests", "Finished requests by finish reason.", ["finish_reason"],
            registry=r,
        )
        self.errors = Counter(
            f"{PREFIX}_request_errors", "Error responses by error type.", ["type"], registry=r
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Time to first token.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.tpot = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            buckets=_TPOT_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds", "Request latency, arrival to last token.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self._window: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()
        r.register(_EngineCollector(stats_fn, self.tokens_per_second))

    def record_generated(self, n: int) -> None:
        if n <= 0:
            return
        self.generation_tokens.inc(n)
        now = time.monotonic()
        with self._lock:
            self._window.append((now, n))
            self._trim(now)

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            total = sum(n for _, n in self._window)
        return total / TOKENS_PER_S_WINDOW_S

    def _trim(self, now: float) -> None:
        while self._window and self._window[0][0] < now - TOKENS_PER_S_WINDOW_S:
            self._window.popleft()

    def record_error(self, error_type: str) -> None:
        self.errors.labels(type=error_type).inc()

    def track(self, num_prompt_tokens: int) -> RequestTracker:
        self.prompt_tokens.inc(num_prompt_tokens)
        return RequestTracker(self)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTracker:
    """Latency bookkeeping of one request; feeds ServerMetrics."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.start = time.monotonic()
        self.first_token_at: float | None = None
        self.num_output_tokens = 0
        self.finished = False

    def on_tokens(self, n: int) -> None:
        if n <= 0:
            return
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
            self.metrics.ttft.observe(self.first_token_at - self.start)
        self.num_output_tokens += n
        self.metrics.record_generated(n)

    def finish(self, finish_reason: str | None) -> None:
        if self.finished:
            return
        self.finished = True
        now = time.monotonic()
        self.metrics.requests.labels(finish_reason=finish_reason or "abort").inc()
        self.metrics.e2e.observe(now - self.start)
        if self.first_token_at is not None and self.num_output_tokens > 1:
            self.metrics.tpot.observe((now - self.first_token_at) / (self.num_output_tokens - 1))
