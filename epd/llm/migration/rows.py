"""Feature-pool helpers for migrations: all-or-nothing allocation, row addressing.

A feature entry of `num_tokens` rows in blocks of `block_tokens` keeps row `r` at pool
row `block_ids[r // block_tokens] * block_tokens + r % block_tokens`; migrations address
rows, so an encoder and an LLM engine may use different block sizes.
"""

from __future__ import annotations

from typing import Any

import torch


def row_ids(block_ids: list[int], block_tokens: int, num_tokens: int) -> list[int]:
    """Pool row index of each of an entry's `num_tokens` rows, in order."""
    return [block_ids[r // block_tokens] * block_tokens + r % block_tokens
            for r in range(num_tokens)]


def allocate_all(cache: Any, wanted: list[tuple[str, int]]) -> tuple[list[Any], set[int]] | None:
    """One ref per `(mm_hash, num_tokens)` from `cache.get_or_allocate`, all or nothing,
    plus the indices of newly created (pending) entries; None if the pool is full (the
    refs taken so far are handed back: new pending entries are dropped, nothing read)."""
    entries: list[Any] = []
    created: set[int] = set()
    try:
        for k, (mm_hash, num_tokens) in enumerate(wanted):
            got = cache.get_or_allocate(mm_hash, num_tokens)
            if got is None:
                break
            entries.append(got[0])
            if got[1]:
                created.add(k)
        else:
            return entries, created
    except BaseException:
        for e in entries:
            cache.release(e)
        raise
    for e in entries:
        cache.release(e)
    return None


def entry_rows(cache: Any, entry: Any) -> torch.Tensor:
    """The entry's `[num_tokens, hidden]` rows (pending or ready; the caller holds a ref):
    a view of the pool when its blocks are adjacent, else a copy."""
    ids, bt, n = entry.block_ids, cache.block_tokens, entry.num_tokens
    rows = cache.tensor.view(-1, cache.hidden_size)
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return rows[ids[0] * bt : ids[0] * bt + n]
    return torch.cat([rows[b * bt : b * bt + min(bt, n - i * bt)] for i, b in enumerate(ids)])
