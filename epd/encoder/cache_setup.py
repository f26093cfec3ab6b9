"""The encoder's multimodal cache: sizing it from the config, its stats, and checking it
against the lease table.

Invariant checked by `check_leased_refs`: when no encode is queued or in flight, exactly
the leased entries hold cache refs, one ref per lease.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from epd.encoder.config import EncoderConfig
from epd.mmcache import LeaseTable, MMCache, MMEntry

logger = logging.getLogger(__name__)


def resolve_dtype(name: Any, spec: Any) -> torch.dtype:
    """`auto` -> the checkpoint's dtype (float32 if it names none)."""
    if name == "auto":
        name = getattr(spec, "dtype", None) or getattr(spec, "torch_dtype", None) or "float32"
    if isinstance(name, torch.dtype):
        return name
    return getattr(torch, str(name).removeprefix("torch."))


def make_cache(config: EncoderConfig, hidden: int, dtype: torch.dtype) -> MMCache:
    bt, dev = config.mm_block_tokens, config.device
    if config.mm_num_blocks is not None:
        return MMCache(config.mm_num_blocks, bt, hidden, dtype, device=dev)
    return MMCache.from_memory_budget(config.mm_cache_memory, bt, hidden, dtype, device=dev)


def log_sizes(config: EncoderConfig, vision: Any, cache: MMCache) -> None:
    n_params, esize = int(getattr(vision, "num_parameters", 0)), cache.tensor.element_size()
    logger.info(
        "encoder %s: vision model %s: %.2fM parameters (~%.1f MiB %s on %s); mm cache "
        "%d blocks x %d tokens x %d hidden = %.1f MiB", config.encoder_id, config.model,
        n_params / 1e6, n_params * esize / 2**20, cache.dtype, config.device,
        cache.num_blocks, cache.block_tokens, cache.hidden_size,
        cache.tensor.numel() * esize / 2**20,
    )  # fmt: skip


def cache_stats(cache: MMCache) -> dict[str, int]:
    """The cache's part of the encoder's `/health` and `/stats` numbers."""
    return {
        "blocks_total": cache.num_blocks,
        "blocks_used": cache.num_used_blocks,
        "blocks_free": cache.num_free_blocks,
        "blocks_referenced": cache.num_referenced_blocks,
        "blocks_evictable": cache.num_evictable_blocks,
        "block_tokens": cache.block_tokens,
        "entries": cache.num_entries,
        "evictions": cache.evictions,
    }


def check_leased_refs(cache: MMCache, leases: LeaseTable[MMEntry]) -> None:
    """Raise AssertionError unless every leased entry is live with exactly one ref per
    lease and the referenced blocks are exactly the leased ones (call when idle)."""
    leased = [lease.payload for lease in leases.snapshot()]
    entries = {id(e): e for e in leased}
    for entry in entries.values():
        n = sum(1 for e in leased if e is entry)
        if entry.freed or entry.ref_count != n:
            raise AssertionError(f"{entry!r} is held by {n} lease(s)")
    leased_blocks = sum(len(e.block_ids) for e in entries.values())
    if cache.num_referenced_blocks != leased_blocks:
        raise AssertionError(
            f"{cache.num_referenced_blocks} referenced blocks, {leased_blocks} leased"
        )
