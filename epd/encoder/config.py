"""The encoder server's configuration: one frozen dataclass, validated at construction.

Runtime-derived values (the number of cache blocks once the model's hidden size is
known, the bound port) live in the engine/server, not here.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

TRANSFER_KINDS = ("auto", "tcp", "rdma", "nvlink")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_MM_CACHE_MEMORY = 256 * 1024**2

@dataclass(frozen=True)
class EncoderConfig:
    model: str
    host: str = "127.0.0.1"
    port: int = 8100
    ack_port: int = 0  # ZMQ PULL port for acks; 0: a free port on `host`
    proxy_url: str | None = None
    transfer: str = "auto"
    max_batch_images: int = 16
    batch_window_ms: float = 3.0
    mm_block_tokens: int = 16
    # Exactly one sizing is used: mm_num_blocks when given, else mm_cache_memory bytes.
    mm_cache_memory: int = DEFAULT_MM_CACHE_MEMORY
    mm_num_blocks: int | None = None
    lease_seconds: float = 60.0
    alloc_timeout_seconds: float = 5.0
    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] | None = None
    limit_images_per_request: int = 8
    dtype: str = "auto"
    device: str = "cpu"
    encoder_id: str = field(default_factory=lambda: f"encoder-{uuid.uuid4().hex[:12]}")
    pool_name: str = "mm_features"
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model is required")
        for name in ("port", "ack_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in 0..65535, got {getattr(self, name)}")
        if self.transfer not in TRANSFER_KINDS:
            raise ValueError(f"transfer must be one of {TRANSFER_KINDS}, got {self.transfer!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _positive("max_batch_images", self.max_batch_images)
        _positive("mm_block_tokens", self.mm_block_tokens)
        _positive("mm_cache_memory", self.mm_cache_memory)
        _positive("lease_seconds", self.lease_seconds)
        _positive("limit_images_per_request", self.limit_images_per_request)
        if self.mm_num_blocks is not None:
            _positive("mm_num_blocks", self.mm_num_blocks)
        if self.batch_window_ms < 0:
            raise ValueError(f"batch_window_ms must be >= 0, got {self.batch_window_ms}")
        if self.alloc_timeout_seconds < 0:
            raise ValueError(
                f"alloc_timeout_seconds must be >= 0, got {self.alloc_timeout_seconds}"
            )
        if not self.encoder_id or not self.pool_name:
            raise ValueError("encoder_id and pool_name must be non-empty")

    @property
    def url(self) -> str:
        """The HTTP base URL peers use (handshake, release); IPv6 hosts are bracketed."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def batch_window_s(self) -> float:
        return self.batch_window_ms / 1000.0

    @property
    def lease_sweep_interval_s(self) -> float:
        # Expired leases are freed within a quarter of their ttl (at most 1 s late).
        return min(1.0, max(0.05, self.lease_seconds / 4))


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
