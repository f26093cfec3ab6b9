"""Paged KV block manager (vLLM-v1 style): block ids, ref counts and a prefix cache.

The KV tensor lives elsewhere (``epd.llm.kv_cache``); this module only hands out ids.

Invariants (``check_integrity()`` verifies all of them):
- Every block is either free (ref count 0, in the free queue) or used (ref count > 0),
  never both: ``num_free_blocks + num_used_blocks == num_blocks``.
- A block's ref count equals the number of its holders: request block tables plus holds
  (blocks handed to another process, released by ``release(hold_id)``).
- A block has a hash iff the prefix-cache map points at it. A free block keeps its hash
  (it stays findable) until it is handed out again (evicted).
- Free-queue order is the eviction order: allocation pops from the front. A freed
  block with a hash goes to the back (LRU: freed last, evicted last; a request's tail
  blocks are freed before its head so shared prefixes survive longer, as in vLLM); a
  freed block without a hash is worthless and goes to the front.
- Hashes are deterministic across processes (blake2b, never Python's ``hash()``) and
  chained: a block's hash covers its parent's hash, its token ids and, for every image
  span overlapping it, the image's ``mm_hash`` and the overlap offsets, so identical
  placeholder ids with different images never collide.
- Failing operations (``allocate``, ``append_slots``, ``allocate_blocks`` returning
  None/False) change nothing.

Not thread-safe: the scheduler thread owns it.
"""

from __future__ import annotations

import hashlib
import struct
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

BlockHash = bytes

_ROOT = b"\x00" * 32


@dataclass(frozen=True)
class MMSpanHash:
    """An image's placeholder span in the prompt: ``length`` tokens from ``offset``."""

    offset: int
    length: int
    mm_hash: str


@dataclass(frozen=True)
class AllocResult:
    block_ids: list[int]
    num_cached_tokens: int


@dataclass(frozen=True)
class PrefixCacheStats:
    queries: int  # full blocks looked up (on successful allocations)
    hits: int  # of those, found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def hash_block_tokens(
    token_ids: Sequence[int],
    block_size: int,
    mm_spans: Sequence[MMSpanHash] = (),
    parent: bytes | None = None,
    *,
    start_block: int = 0,
) -> list[BlockHash]:
    """Chained hashes of the FULL blocks of ``token_ids`` (a trailing partial block has
    none). With ``start_block=k`` and ``parent`` = the hash of block ``k-1``, only blocks
    ``k..`` are hashed (incremental hashing during decode); offsets stay absolute."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    spans = sorted(mm_spans, key=lambda s: (s.offset, s.length, s.mm_hash))
    prev = _ROOT if parent is None else parent
    out: list[BlockHash] = []
    for b in range(start_block, len(token_ids) // block_size):
        start, end = b * block_size, (b + 1) * block_size
        h = hashlib.blake2b(digest_size=32)
        h.update(prev)
        h.update(struct.pack(f"<{block_size}q", *token_ids[start:end]))
        for span in spans:
            lo, hi = max(start, span.offset), min(end, span.offset + span.length)
            if lo >= hi:
                continue
            key = span.mm_hash.encode()
            # (position in block, position in image, overlap length) + the image hash
            h.update(struct.pack("<qqqq", lo - start, lo - span.offset, hi - lo, len(key)))
            h.update(key)
        prev = h.digest()
        out.append(prev)
    return out


class _Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None


class KVBlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}"
            )
        self._num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self._tables: dict[str, list[int]] = {}
        self._holds: dict[str, list[int]] = {}
        self._queries = 0
        self._hits = 0
        self.num_evictions = 0

    # -- queries ---------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, including evictable cached ones."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self._num_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._queries, self._hits)

    def has(self, req_id: str) -> bool:
        return req_id in self._tables

    def block_table(self, req_id: str) -> list[int]:
        return list(self._tables[req_id])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- allocation ------------------------------------------------------------------

    def allocate(
        self, req_id: str, num_tokens: int, block_hashes: Sequence[BlockHash] = ()
    ) -> AllocResult | None:
        """First allocation of a request: reuse the longest cached prefix (never the
        whole prompt: at least one token is computed), fresh blocks for the rest."""
        if req_id in self._tables:
            raise ValueError(f"request {req_id!r} already has blocks")
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        hits: list[int] = []
        max_hits = min(len(block_hashes), (num_tokens - 1) // self.block_size)
        if self.enable_prefix_caching:
            for h in block_hashes[:max_hits]:
                bid = self._cached.get(h)
                if bid is None:
                    break
                hits.append(bid)
        num_new = self.blocks_needed(num_tokens) - len(hits)
        revived = sum(1 for bid in hits if self._blocks[bid].ref_cnt == 0)
        if num_new > len(self._free) - revived:
            return None
        for bid in hits:
            self._ref(bid)
        table = hits + self._pop_free(num_new)
        self._tables[req_id] = table
        if self.enable_prefix_caching:
            self._queries += max_hits
            self._hits += len(hits)
        return AllocResult(list(table), len(hits) * self.block_size)

    def append_slots(self, req_id: str, num_total_tokens: int) -> bool:
        """Grow the request's table to cover ``num_total_tokens``; False (no change) if
        there are not enough free blocks."""
        table = self._tables[req_id]
        num_new = self.blocks_needed(num_total_tokens) - len(table)
        if num_new <= 0:
            return True
        if num_new > len(self._free):
            return False
        table.extend(self._pop_free(num_new))
        return True

    def allocate_blocks(self, req_id: str, n: int) -> list[int] | None:
        """``n`` fresh blocks appended to ``req_id``'s table (created if absent), no
        prefix lookup: the target of a migration. None (no change) if not enough."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > len(self._free):
            return None
        new = self._pop_free(n)
        self._tables.setdefault(req_id, []).extend(new)
        return new

    def cache_blocks(
        self, req_id: str, block_hashes: Sequence[BlockHash], num_computed_tokens: int
    ) -> None:
        """Register the request's full, computed blocks under their hashes. Idempotent;
        a hash already owned by another block leaves this block uncached."""
        if not self.enable_prefix_caching:
            return
        table = self._tables[req_id]
        n = min(num_computed_tokens // self.block_size, len(block_hashes), len(table))
        for bid, h in zip(table[:n], block_hashes[:n], strict=True):
            block = self._blocks[bid]
            if block.block_hash is not None:
                if block.block_hash != h:
                    raise RuntimeError(f"block {bid} of {req_id!r} is cached under another hash")
                continue
            if h not in self._cached:
                block.block_hash = h
                self._cached[h] = bid

    # -- release ---------------------------------------------------------------------

    def free(self, req_id: str) -> None:
        """Drop the request's refs (tail first). Unknown ids are ignored (idempotent)."""
        table = self._tables.pop(req_id, None)
        if table is not None:
            self._unref_all(table)

    def hold(self, block_ids: Sequence[int]) -> str:
        """Extra refs on blocks handed to another process; returns the hold id."""
        for bid in block_ids:
            if not 0 <= bid < self._num_blocks or self._blocks[bid].ref_cnt == 0:
                raise ValueError(f"can only hold allocated blocks, got block {bid}")
        for bid in block_ids:
            self._blocks[bid].ref_cnt += 1
        hold_id = uuid.uuid4().hex
        self._holds[hold_id] = list(block_ids)
        return hold_id

    def release(self, hold_id: str) -> bool:
        """Drop a hold's refs. False if unknown or already released (idempotent)."""
        blocks = self._holds.pop(hold_id, None)
        if blocks is None:
            return False
        self._unref_all(blocks)
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. False (no change) while any block is in use, since
        a used block's hash may be relied on by its request."""
        if self.num_used_blocks:
            return False
        for block in self._blocks:
            block.block_hash = None
        self._cached.clear()
        self._queries = self._hits = 0
        return True

    # -- internals -------------------------------------------------------------------

    def _ref(self, bid: int) -> None:
        block = self._blocks[bid]
        if block.ref_cnt == 0:
            del self._free[bid]
        block.ref_cnt += 1

    def _pop_free(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            bid, _ = self._free.popitem(last=False)
            block = self._blocks[bid]
            if block.block_hash is not None:  # evict
                del self._cached[block.block_hash]
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(bid)
        return out

    def _unref_all(self, block_ids: Sequence[int]) -> None:
        unhashed: list[int] = []
        for bid in reversed(block_ids):
            block = self._blocks[bid]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    unhashed.append(bid)
                else:
                    self._free[bid] = None  # back of the queue: evicted last
        # Worthless blocks go to the front, in table order, so they are reused first.
        for bid in unhashed:
            self._free[bid] = None
            self._free.move_to_end(bid, last=False)

    def check_integrity(self) -> None:
        holders = [0] * self._num_blocks
        for owner, ids in [*self._tables.items(), *self._holds.items()]:
            if len(set(ids)) != len(ids):
                raise AssertionError(f"{owner!r} lists a block twice: {ids}")
            for bid in ids:
                holders[bid] += 1
        for block in self._blocks:
            bid = block.block_id
            if block.ref_cnt != holders[bid]:
                raise AssertionError(
                    f"block {bid}: ref_cnt {block.ref_cnt} but {holders[bid]} holders"
                )
            if (block.ref_cnt == 0) != (bid in self._free):
                raise AssertionError(
                    f"block {bid}: ref_cnt {block.ref_cnt}, free={bid in self._free}"
                )
            if block.block_hash is not None and self._cached.get(block.block_hash) != bid:
                raise AssertionError(f"block {bid} has a hash the cache map does not point at")
        for h, bid in self._cached.items():
            if self._blocks[bid].block_hash != h:
                raise AssertionError(f"cache map entry for block {bid} disagrees with the block")
        used = sum(1 for b in self._blocks if b.ref_cnt > 0)
        if used + len(self._free) != self._num_blocks:
            raise AssertionError(f"free {len(self._free)} + used {used} != {self._num_blocks}")
