"""Prometheus metrics of one encoder engine.

Each engine owns its own `CollectorRegistry`, so several engines in one process (tests)
never collide. Pool and lease gauges are read at scrape time from callables, so they can
never drift from the cache's own counts.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class EncoderMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.images_encoded = Counter(
            "epd_encoder_images_encoded", "Images run through the vision model", registry=r
        )
        self.cache_hits = Counter(
            "epd_encoder_cache_hits",
            "Images served from the mm cache or from an encode already in flight",
            registry=r,
        )
        self.cache_misses = Counter(
            "epd_encoder_cache_misses", "Images that had to be encoded", registry=r
        )
        self.leases_expired = Counter(
            "epd_encoder_leases_expired", "Leases freed by expiry (the ack never came)", registry=r
        )
        self.leases_released = Counter(
            "epd_encoder_leases_released",
            "Leases freed by an ack or an explicit release",
            registry=r,
        )
        self.alloc_timeouts = Counter(
            "epd_encoder_alloc_timeouts",
            "Requests refused (503) because the pool stayed full",
            registry=r,
        )
        self.encode_latency = Histogram(
            "epd_encoder_encode_latency_seconds",
            "Wall time of one batched vision forward (incl. writing the cache)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "epd_encoder_batch_size",
            "Images per vision forward",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.blocks_used = Gauge("epd_encoder_mm_blocks_used", "mm cache blocks in use", registry=r)
        self.blocks_free = Gauge("epd_encoder_mm_blocks_free", "mm cache blocks free", registry=r)
        self.blocks_referenced = Gauge(
            "epd_encoder_mm_blocks_referenced",
            "mm cache blocks held by a request or lease",
            registry=r,
        )
        self.leases_active = Gauge(
            "epd_encoder_leases_active", "Leases not yet released", registry=r
        )

    def bind_gauges(
        self,
        *,
        blocks_used: Callable[[], float],
        blocks_free: Callable[[], float],
        blocks_referenced: Callable[[], float],
        leases_active: Callable[[], float],
    ) -> None:
        self.blocks_used.set_function(blocks_used)
        self.blocks_free.set_function(blocks_free)
        self.blocks_referenced.set_function(blocks_referenced)
        self.leases_active.set_function(leases_active)

    def render(self) -> bytes:
        return generate_latest(self.registry)
