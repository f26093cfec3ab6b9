"""Attention backend interface and registry.

A backend computes attention for one layer of a packed batch from the paged KV cache:
it first stores the new tokens' K/V at their slots, then attends each query to its own
sequence's cached prefix plus the new tokens (causal). Grouped-query attention is
handled by the backend (num_heads a multiple of num_kv_heads).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from epd.llm.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    name: str = ""

    @abstractmethod
    def forward(
        self,
        layer_idx: int,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,
        meta: AttentionMetadata,
        scaling: float | None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...


_REGISTRY: dict[str, Callable[[], AttentionBackend]] = {}


def register_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    _REGISTRY[name] = factory


def get_backend(name: str) -> AttentionBackend:
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(_REGISTRY)}")
    return _REGISTRY[name]()


def available_backends() -> list[str]:
    return sorted(_REGISTRY)
