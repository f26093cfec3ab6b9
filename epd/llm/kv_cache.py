"""The paged KV cache: one contiguous tensor for all layers.

Layout `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`: the bytes of
one block (every layer, K and V) are contiguous, so the whole tensor is registered once
with the transfer engine and a block migrates as one range of `block_nbytes` bytes at
offset `block_id * block_nbytes`. A slot is `block_id * block_size + offset`.
"""

from __future__ import annotations

import torch

from epd.llm.config import CacheLayout


class PagedKVCache:
    def __init__(self, layout: CacheLayout, device: str | torch.device = "cpu") -> None:
        self.layout = layout
        self.block_size = layout.block_size
        # Zeros, not empty: padded gather positions are masked, but a NaN there would
        # still poison the attention output (0 * NaN).
        self.tensor = torch.zeros(
            layout.num_blocks,
            layout.num_layers,
            2,
            layout.block_size,
            layout.num_kv_heads,
            layout.head_dim,
            dtype=getattr(torch, layout.dtype),
            device=device,
        )

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    @property
    def block_nbytes(self) -> int:
        return self.tensor[0].numel() * self.tensor.element_size()

    def block_range(self, block_id: int) -> tuple[int, int]:
        """(byte offset, length) of one block inside `tensor`."""
        return block_id * self.block_nbytes, self.block_nbytes

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views `[num_blocks, block_size, num_kv_heads, head_dim]` of one layer's K and V."""
        return self.tensor[:, layer_idx, 0], self.tensor[:, layer_idx, 1]

    def write(
        self,
        layer_idx: int,
        slot_blocks: torch.Tensor,
        slot_offsets: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> None:
        """Store K/V `[T, num_kv_heads, head_dim]` of new tokens at their slots."""
        k_cache, v_cache = self.layer(layer_idx)
        k_cache[slot_blocks, slot_offsets] = key.to(k_cache.dtype)
        v_cache[slot_blocks, slot_offsets] = value.to(v_cache.dtype)

    def gather(
        self, layer_idx: int, block_tables: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of whole blocks: block_tables `[B, n]` -> `[B, n * block_size, kv_heads, head_dim]`."""
        k_cache, v_cache = self.layer(layer_idx)
        b, n = block_tables.shape
        flat = block_tables.reshape(-1)
        # index_select copies whole blocks (one contiguous chunk each): faster on CPU than
        # advanced indexing on this strided per-layer view.
        k = k_cache.index_select(0, flat).view(b, n * self.block_size, *k_cache.shape[2:])
        v = v_cache.index_select(0, flat).view(b, n * self.block_size, *v_cache.shape[2:])
        return k, v

    def read_tokens(self, layer_idx: int, block_ids: list[int], num_tokens: int):
        """K/V of a sequence's first `num_tokens` tokens (for tests and migration checks)."""
        table = torch.tensor([block_ids], dtype=torch.long, device=self.tensor.device)
        k, v = self.gather(layer_idx, table)
        return k[0, :num_tokens], v[0, :num_tokens]


def num_blocks_for_budget(memory_bytes: int, block_nbytes: int) -> int:
    n = memory_bytes // block_nbytes
    if n < 1:
        raise ValueError(
            f"kv_cache_memory_bytes={memory_bytes} is smaller than one KV block ({block_nbytes} bytes)"
        )
    return int(n)
