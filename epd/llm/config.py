"""Engine configuration.

`EngineConfig` is frozen and validated at construction; values derived at start from
the checkpoint and the memory budget (number of KV blocks, the model's context length)
live in `CacheLayout`, never in the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

VISION_MODES = ("local", "none")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "cpu", "cuda")
TRANSFER_KINDS = ("auto", "tcp", "rdma", "nvlink")
ROLES = ("llm", "prefill", "decode")


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str | Path
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = 256 * 1024 * 1024
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    vision: str = "local"
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    seed: int = 0
    # EPD migration: the LLM-side feature pool (created on the first EPD request; sized
    # by mm_num_blocks when given, else by mm_cache_memory_bytes) and its transfer engine.
    mm_block_tokens: int = 16
    mm_num_blocks: int | None = None
    mm_cache_memory_bytes: int = 64 * 1024 * 1024
    transfer: str = "auto"
    transfer_host: str = "127.0.0.1"  # data-plane address (a concrete local IP)
    migration_timeout_s: float = 30.0
    engine_id: str | None = None  # transfer id presented to peers (default: random)
    # PD disaggregation: "prefill" prefills, keeps the KV blocks under a lease of
    # lease_seconds and hands them over; "decode" pulls them (epd.llm.pd).
    role: str = "llm"
    lease_seconds: float = 60.0
    public_url: str = "http://127.0.0.1:8000"  # this server's HTTP base URL (handshakes)

    def __post_init__(self) -> None:
        def positive(name: str, value: int | None) -> None:
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        positive("block_size", self.block_size)
        positive("num_blocks", self.num_blocks)
        positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        positive("max_num_batched_tokens", self.max_num_batched_tokens)
        positive("max_num_seqs", self.max_num_seqs)
        positive("max_model_len", self.max_model_len)
        positive("mm_block_tokens", self.mm_block_tokens)
        positive("mm_num_blocks", self.mm_num_blocks)
        positive("mm_cache_memory_bytes", self.mm_cache_memory_bytes)
        if self.transfer not in TRANSFER_KINDS:
            raise ValueError(f"transfer must be one of {TRANSFER_KINDS}, got {self.transfer!r}")
        if not self.migration_timeout_s > 0:
            raise ValueError(f"migration_timeout_s must be > 0, got {self.migration_timeout_s!r}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.lease_seconds > 0:
            raise ValueError(f"lease_seconds must be > 0, got {self.lease_seconds!r}")
        if self.vision not in VISION_MODES:
            raise ValueError(f"vision must be one of {VISION_MODES}, got {self.vision!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if not (self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if not self.enable_chunked_prefill and self.max_model_len is not None:
            if self.max_num_batched_tokens < self.max_model_len:
                raise ValueError(
                    "without chunked prefill max_num_batched_tokens must be >= max_model_len"
                )

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.resolved_device().startswith("cuda") else "float32"

    def resolved_attention_backend(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        return "cuda" if self.resolved_device().startswith("cuda") else "cpu"


@dataclass(frozen=True)
class CacheLayout:
    """Runtime-derived KV cache geometry (logged at engine start)."""

    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    max_model_len: int

    @property
    def block_nbytes(self) -> int:
        import torch

        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    @property
    def total_nbytes(self) -> int:
        return self.num_blocks * self.block_nbytes

    def as_dict(self) -> dict:
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "block_nbytes": self.block_nbytes,
        }
