"""Fixed-size block allocator for the multimodal feature pool.

Invariants: every block id in ``range(num_blocks)`` is either free or allocated, never
both; allocation hands out the lowest free ids (so entries tend to be contiguous and a
transfer merges into few ranges); ``allocate`` is all-or-nothing. Not thread-safe on its
own: ``MMCache`` holds the lock.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))  # a min-heap
        self._free_set = set(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > len(self._free):
            return None
        ids = [heapq.heappop(self._free) for _ in range(n)]
        self._free_set.difference_update(ids)
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        ids = list(block_ids)
        for bid in ids:
            if not 0 <= bid < self.num_blocks:
                raise ValueError(f"block {bid} out of range")
            if bid in self._free_set:
                raise ValueError(f"block {bid} freed twice")
        for bid in ids:
            self._free_set.add(bid)
            heapq.heappush(self._free, bid)

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free_set
