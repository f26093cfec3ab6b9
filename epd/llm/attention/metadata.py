"""Per-step attention metadata for a packed batch.

A step's tokens are packed into one row (batch size 1): first every single-token
sequence (decodes; batched together), then each multi-token prefill chunk. The
metadata is built once per step and shared by every layer: slot mapping for the K/V
writes, padded block tables, cache row ids (`PagedKVCache.row_index`) and key masks for
the batched decode, and per-prefill slices. Layers only add their row offset.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class BatchEntry:
    """One sequence in the packed batch: tokens [num_computed, num_computed + num_new).

    block_table may hold more blocks than the context needs (a migrated image sequence
    reserves its whole length); only the first ceil(context / block_size) are used."""

    block_table: list[int]
    num_computed: int
    num_new: int


@dataclass
class DecodeGroup:
    start: int  # packed tokens [start, end), one per sequence
    end: int
    block_tables: torch.Tensor  # [B, max_blocks] (padded with block 0, masked)
    key_mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size] bool, True = attend
    kv_rows: torch.Tensor  # [2, B, kv_heads, max_blocks] layer-0 cache rows (K, V)
    key_bias: torch.Tensor  # key_mask as an additive 0 / -inf bias, in the cache dtype


@dataclass
class PrefillSlice:
    start: int  # packed token range [start, end)
    end: int
    num_cached: int  # tokens already in the cache before this chunk
    block_table: torch.Tensor  # [1, n] blocks covering num_cached + (end - start) tokens
    key_mask: torch.Tensor | None  # [L, num_cached + L] bool; None = plain causal, no prefix
    kv_rows: torch.Tensor | None = None  # [2, 1, kv_heads, n] layer-0 cache rows; with a prefix


@dataclass
class AttentionMetadata:
    kv_cache: object  # PagedKVCache
    backend: object  # AttentionBackend
    slot_blocks: torch.Tensor  # [T]
    slot_offsets: torch.Tensor  # [T]
    decodes: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSlice] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_blocks.shape[0])

    @property
    def num_decode_tokens(self) -> int:
        return self.decodes[-1].end if self.decodes else 0


# Decodes are split into groups of similar context length so that padding the gathered
# keys to the longest context of a group wastes little (the scheduler sorts decodes by
# context length). A group grows while its longest context needs at most GROUP_GROWTH
# times the blocks of its shortest (for sorted input: at most log_1.5(max/min) groups).
GROUP_GROWTH = 1.5


def _decode_groups(nblocks: list[int]) -> list[tuple[int, int]]:
    groups, start, lo, hi = [], 0, nblocks[0] if nblocks else 0, 0
    for i, n in enumerate(nblocks):
        lo, hi = min(lo, n), max(hi, n)
        if hi > GROUP_GROWTH * lo:
            groups.append((start, i))
            start, lo, hi = i, n, n
    if nblocks:
        groups.append((start, len(nblocks)))
    return groups


def build_attention_metadata(
    entries: list[BatchEntry], block_size: int, kv_cache, backend, device: torch.device | str
) -> AttentionMetadata:
    """Entries must be in packed order with all single-token entries first."""
    decodes = [e for e in entries if e.num_new == 1]
    if any(e.num_new != 1 for e in entries[: len(decodes)]):
        raise ValueError("single-token entries must come first in the packed batch")
    slot_blocks: list[int] = []
    slot_offsets: list[int] = []
    groups: list[DecodeGroup] = []
    if decodes:
        for e in decodes:
            slot_blocks.append(e.block_table[e.num_computed // block_size])
            slot_offsets.append(e.num_computed % block_size)
        ctx = [e.num_computed + 1 for e in decodes]
        nblocks = [(c + block_size - 1) // block_size for c in ctx]
        for lo, hi in _decode_groups(nblocks):
            width = max(nblocks[lo:hi])
            padded = [e.block_table[:nb] + [0] * (width - nb)
                      for e, nb in zip(decodes[lo:hi], nblocks[lo:hi], strict=True)]
            ctx_t = torch.tensor(ctx[lo:hi], device=device)
            key_pos = torch.arange(width * block_size, device=device)
            tables = torch.tensor(padded, dtype=torch.long, device=device)
            key_mask = (key_pos[None, :] < ctx_t[:, None])[:, None, None, :]
            bias = torch.zeros(key_mask.shape, dtype=kv_cache.tensor.dtype, device=device)
            groups.append(DecodeGroup(
                start=lo,
                end=hi,
                block_tables=tables,
                key_mask=key_mask,
                kv_rows=kv_cache.row_index(tables),
                key_bias=bias.masked_fill_(~key_mask, float("-inf")),
            ))
    prefills: list[PrefillSlice] = []
    start = len(decodes)
    for e in entries[len(decodes) :]:
        total = e.num_computed + e.num_new
        nblocks = (total + block_size - 1) // block_size
        pos = range(e.num_computed, total)
        slot_blocks.extend(e.block_table[p // block_size] for p in pos)
        slot_offsets.extend(p % block_size for p in pos)
        mask, rows = None, None
        table = torch.tensor([e.block_table[:nblocks]], dtype=torch.long, device=device)
        if e.num_computed:
            q_pos = torch.arange(e.num_computed, total, device=device)
            mask = torch.arange(total, device=device)[None, :] <= q_pos[:, None]
            rows = kv_cache.row_index(table)
        prefills.append(
            PrefillSlice(
                start=start,
                end=start + e.num_new,
                num_cached=e.num_computed,
                block_table=table,
                key_mask=mask,
                kv_rows=rows,
            )
        )
        start += e.num_new
    return AttentionMetadata(
        kv_cache=kv_cache,
        backend=backend,
        slot_blocks=torch.tensor(slot_blocks, dtype=torch.long, device=device),
        slot_offsets=torch.tensor(slot_offsets, dtype=torch.long, device=device),
        decodes=groups,
        prefills=prefills,
    )
