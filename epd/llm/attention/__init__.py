"""Paged attention: backends (`cpu`, `cuda`) behind a registry, metadata, transformers bridge.

Importing this package registers the backends and the transformers attention
implementation `epd_paged`.
"""

from __future__ import annotations

from epd.llm.attention.base import (
    AttentionBackend,
    available_backends,
    get_backend,
    register_backend,
)
from epd.llm.attention.cpu import CPUAttentionBackend
from epd.llm.attention.cuda import CUDAAttentionBackend
from epd.llm.attention.hf import ATTN_IMPLEMENTATION, epd_paged_attention, register
from epd.llm.attention.metadata import AttentionMetadata, BatchEntry, build_attention_metadata

register_backend("cpu", CPUAttentionBackend)
register_backend("cuda", CUDAAttentionBackend)
register()

__all__ = [
    "ATTN_IMPLEMENTATION",
    "AttentionBackend",
    "AttentionMetadata",
    "BatchEntry",
    "available_backends",
    "build_attention_metadata",
    "epd_paged_attention",
    "get_backend",
    "register_backend",
]
