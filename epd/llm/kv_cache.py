"""The paged KV cache: one contiguous tensor for all layers.

Layout `[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]`: the bytes of
one block (every layer, K and V) are contiguous, so the whole tensor is registered once
with the transfer engine and a block migrates as one range of `block_nbytes` bytes at
offset `block_id * block_nbytes`. A slot is `block_id * block_size + offset`.

Inside a block each kv head's `block_size` tokens are contiguous (head-major), so one
"row" of `block_size * head_dim` values is one (block, layer, K|V, kv head). Gathering
whole rows gives K/V directly in attention layout `[B, kv_heads, tokens, head_dim]`,
contiguous, with one `index_select` per layer and no transpose copy (`row_index`,
`gather_rows`). Both peers of a block migration must use this layout (same code).
"""

from __future__ import annotations

import torch

from epd.llm.config import CacheLayout


class PagedKVCache:
    def __init__(self, layout: CacheLayout, device: str | torch.device = "cpu") -> None:
        self.layout = layout
        self.block_size = layout.block_size
        self.num_kv_heads = layout.num_kv_heads
        self.head_dim = layout.head_dim
        # Zeros, not empty: padded gather positions are masked, but a NaN there would
        # still poison the attention output (0 * NaN).
        self.tensor = torch.zeros(
            layout.num_blocks,
            layout.num_layers,
            2,
            layout.num_kv_heads,
            layout.block_size,
            layout.head_dim,
            dtype=getattr(torch, layout.dtype),
            device=device,
        )
        self._rows = self.tensor.view(-1, layout.block_size * layout.head_dim)

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
        """Views `[num_blocks, block_size, num_kv_heads, head_dim]` of one layer's K and V
        (strided views of the head-major storage; writes through them land in the cache)."""
        t = self.tensor[:, layer_idx]
        return t[:, 0].transpose(1, 2), t[:, 1].transpose(1, 2)

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

    # -- gathering -----------------------------------------------------------------------
    @property
    def layer_row_stride(self) -> int:
        """Row-index distance between one layer's rows and the next layer's."""
        return 2 * self.num_kv_heads

    def row_index(self, block_tables: torch.Tensor) -> torch.Tensor:
        """Layer-0 row ids `[2, B, kv_heads, n]` (K then V) of block_tables `[B, n]`; add
        `layer * layer_row_stride` for another layer. Built once per step."""
        kvh = self.num_kv_heads
        base = block_tables[:, None, :] * (self.layout.num_layers * 2 * kvh)
        heads = torch.arange(kvh, device=block_tables.device)[None, :, None]
        k_rows = base + heads
        return torch.stack([k_rows, k_rows + kvh])

    def gather_rows(
        self, layer_idx: int, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of whole blocks, from `row_index(block_tables)` `[2, B, kvh, n]`:
        contiguous `[B, kv_heads, n * block_size, head_dim]` each (one copy for both)."""
        _, b, kvh, n = rows.shape
        idx = rows.reshape(-1)
        if layer_idx:
            idx = idx + layer_idx * self.layer_row_stride
        kv = self._rows.index_select(0, idx).view(2, b, kvh, n * self.block_size, self.head_dim)
        return kv[0], kv[1]

    def gather(
        self, layer_idx: int, block_tables: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of whole blocks: block_tables `[B, n]` -> `[B, n * block_size, kv_heads, head_dim]`
        (transposed views of `gather_rows`)."""
        k, v = self.gather_rows(layer_idx, self.row_index(block_tables))
        return k.transpose(1, 2), v.transpose(1, 2)

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
