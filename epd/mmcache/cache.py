"""The multimodal feature cache: paged image embeddings keyed by content hash.

One contiguous tensor ``[num_blocks, block_tokens, hidden]`` (registered once with the
transfer engine); an image's ``num_tokens`` feature rows fill ``ceil(num_tokens /
block_tokens)`` blocks in order, row ``i`` at ``(block_ids[i // block_tokens],
i % block_tokens)``.

Invariants (``check_integrity()`` verifies them):
- Every block belongs to exactly one live entry or to the free pool.
- An entry is *pending* (allocated, not yet committed; always referenced by its creator)
  or *ready*. Only ready entries are returned by ``lookup``.
- A ready entry with ref count 0 is cached: it sits in the LRU and may be evicted; a
  referenced entry is never evicted. A pending entry whose last ref goes is dropped.
- Allocation is all-or-nothing: it evicts only when the request can then be satisfied.
- All methods take one lock (the encoder server calls from its event loop and its encode
  worker thread); ``commit`` copies the rows outside the lock, which is safe because a
  pending entry's blocks belong to its creator alone.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from epd.mmcache.pool import BlockPool


@dataclass(eq=False)
class MMEntry:
    mm_hash: str
    num_tokens: int
    block_ids: list[int]
    ref_count: int = 0
    ready: bool = False
    freed: bool = field(default=False, repr=False)  # dropped or evicted: a dead handle


class MMCache:
    def __init__(
        self,
        num_blocks: int,
        block_tokens: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        if block_tokens <= 0 or hidden_size <= 0:
            raise ValueError("block_tokens and hidden_size must be positive")
        self.block_tokens = block_tokens
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.tensor = torch.zeros(num_blocks, block_tokens, hidden_size, dtype=dtype, device=device)
        self._pool = BlockPool(num_blocks)
        self._entries: dict[str, MMEntry] = {}
        self._lru: OrderedDict[str, MMEntry] = OrderedDict()  # ready, unreferenced
        self._lock = threading.RLock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    @classmethod
    def from_memory_budget(
        cls,
        budget_bytes: int,
        block_tokens: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> MMCache:
        block_nbytes = block_tokens * hidden_size * torch.empty((), dtype=dtype).element_size()
        num_blocks = budget_bytes // block_nbytes
        if num_blocks <= 0:
            raise ValueError(
                f"a memory budget of {budget_bytes} bytes holds no block of {block_nbytes} bytes"
            )
        return cls(num_blocks, block_tokens, hidden_size, dtype, device)

    # -- sizes and stats -------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def block_nbytes(self) -> int:
        return self.block_tokens * self.hidden_size * self.tensor.element_size()

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._pool.num_free

    @property
    def num_referenced_blocks(self) -> int:
        with self._lock:
            return sum(len(e.block_ids) for e in self._entries.values() if e.ref_count > 0)

    @property
    def num_evictable_blocks(self) -> int:
        with self._lock:
            return sum(len(e.block_ids) for e in self._lru.values())

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_tokens)

    def __contains__(self, mm_hash: object) -> bool:
        with self._lock:
            return mm_hash in self._entries

    # -- entries ---------------------------------------------------------------------

    def lookup(self, mm_hash: str) -> MMEntry | None:
        """The ready entry for ``mm_hash`` with a new ref taken, or None."""
        with self._lock:
            entry = self._entries.get(mm_hash)
            if entry is None or not entry.ready:
                self.misses += 1
                return None
            self.hits += 1
            self._acquire(entry)
            return entry

    def allocate(self, mm_hash: str, num_tokens: int) -> MMEntry | None:
        """A new pending entry referenced by the caller, evicting LRU cached entries as
        needed; None (nothing evicted) if it cannot fit."""
        with self._lock:
            if mm_hash in self._entries:
                raise ValueError(f"mm_hash {mm_hash!r} is already cached; use get_or_allocate")
            return self._allocate(mm_hash, num_tokens)

    def get_or_allocate(self, mm_hash: str, num_tokens: int) -> tuple[MMEntry, bool] | None:
        """``(entry, created)`` with a ref taken. An existing entry may still be pending
        (another request is encoding it: wait for that encode, do not encode again).
        None if the entry is absent and cannot fit."""
        with self._lock:
            entry = self._entries.get(mm_hash)
            if entry is not None:
                if entry.num_tokens != num_tokens:
                    raise ValueError(
                        f"mm_hash {mm_hash!r} cached with {entry.num_tokens} tokens, "
                        f"asked for {num_tokens}"
                    )
                self.hits += 1
                self._acquire(entry)
                return entry, False
            self.misses += 1
            new = self._allocate(mm_hash, num_tokens)
            return None if new is None else (new, True)

    def commit(self, entry: MMEntry, features: torch.Tensor) -> None:
        """Write the entry's ``[num_tokens, hidden]`` rows and make it ready."""
        expected = (entry.num_tokens, self.hidden_size)
        if tuple(features.shape) != expected:
            raise ValueError(f"features of shape {tuple(features.shape)}, expected {expected}")
        with self._lock:
            self._check_live(entry)
            if entry.ready:
                raise ValueError(f"entry {entry.mm_hash!r} is already committed")
        rows = self.tensor.view(-1, self.hidden_size)
        for first, start, n in self._runs(entry):
            rows[first : first + n].copy_(features[start : start + n])
        with self._lock:
            self._check_live(entry)
            entry.ready = True

    def read(self, entry: MMEntry) -> torch.Tensor:
        """A copy of the entry's ``[num_tokens, hidden]`` rows."""
        with self._lock:
            self._check_live(entry)
            if not entry.ready:
                raise ValueError(f"entry {entry.mm_hash!r} is not committed")
            rows = self.tensor.view(-1, self.hidden_size)
            return torch.cat([rows[first : first + n] for first, _, n in self._runs(entry)])

    def acquire(self, entry: MMEntry) -> None:
        with self._lock:
            self._check_live(entry)
            self._acquire(entry)

    def release(self, entry: MMEntry) -> None:
        """Drop one ref. A ready entry at 0 refs stays cached (most recently used); a
        pending one is dropped. Releasing a dropped entry is a no-op."""
        with self._lock:
            if entry.freed:
                return
            if entry.ref_count <= 0:
                raise ValueError(f"entry {entry.mm_hash!r} released more often than acquired")
            entry.ref_count -= 1
            if entry.ref_count == 0:
                if entry.ready:
                    self._lru[entry.mm_hash] = entry
                else:
                    self._free_entry(entry)

    def drop(self, entry: MMEntry) -> None:
        """Abandon a pending entry (failed encode): its blocks are freed now, whoever
        holds refs on it. Idempotent."""
        with self._lock:
            if entry.freed:
                return
            if entry.ready:
                raise ValueError(f"entry {entry.mm_hash!r} is committed; release it instead")
            self._free_entry(entry)

    def peek(self, mm_hash: str) -> MMEntry | None:
        """The entry (ready or pending) without taking a ref."""
        with self._lock:
            return self._entries.get(mm_hash)

    # -- internals -------------------------------------------------------------------

    def _allocate(self, mm_hash: str, num_tokens: int) -> MMEntry | None:
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        n = self.blocks_needed(num_tokens)
        evictable = sum(len(e.block_ids) for e in self._lru.values())
        if n > self._pool.num_free + evictable:
            return None
        while self._pool.num_free < n:
            _, victim = self._lru.popitem(last=False)
            self._free_entry(victim)
            self.evictions += 1
        block_ids = self._pool.allocate(n)
        assert block_ids is not None
        entry = MMEntry(mm_hash, num_tokens, block_ids, ref_count=1)
        self._entries[mm_hash] = entry
        return entry

    def _acquire(self, entry: MMEntry) -> None:
        if entry.ref_count == 0:
            self._lru.pop(entry.mm_hash, None)
        entry.ref_count += 1

    def _free_entry(self, entry: MMEntry) -> None:
        self._entries.pop(entry.mm_hash, None)
        self._lru.pop(entry.mm_hash, None)
        self._pool.free(entry.block_ids)
        entry.freed = True
        entry.ref_count = 0

    def _check_live(self, entry: MMEntry) -> None:
        if entry.freed or self._entries.get(entry.mm_hash) is not entry:
            raise ValueError(f"entry {entry.mm_hash!r} was dropped or evicted")

    def _runs(self, entry: MMEntry) -> list[tuple[int, int, int]]:
        """(first pool row, first entry row, row count) per run of adjacent blocks."""
        bt = self.block_tokens
        runs: list[tuple[int, int, int]] = []
        for i, bid in enumerate(entry.block_ids):
            n = min(bt, entry.num_tokens - i * bt)
            if runs and runs[-1][0] + runs[-1][2] == bid * bt:
                first, start, count = runs[-1]
                runs[-1] = (first, start, count + n)
            else:
                runs.append((bid * bt, i * bt, n))
        return runs

    def check_integrity(self) -> None:
        with self._lock:
            owner: dict[int, str] = {}
            for key, e in self._entries.items():
                if key != e.mm_hash or e.freed:
                    raise AssertionError(f"entry {key!r} is indexed wrongly")
                if len(e.block_ids) != self.blocks_needed(e.num_tokens):
                    raise AssertionError(f"entry {key!r} has {len(e.block_ids)} blocks")
                for bid in e.block_ids:
                    if bid in owner or self._pool.is_free(bid):
                        raise AssertionError(f"block {bid} of {key!r} is also elsewhere")
                    owner[bid] = key
                if e.ref_count < 0 or (e.ref_count == 0 and not e.ready):
                    raise AssertionError(f"entry {key!r}: ref_count {e.ref_count}, ready {e.ready}")
                if (key in self._lru) != (e.ref_count == 0):
                    raise AssertionError(
                        f"entry {key!r}: ref_count {e.ref_count}, in LRU {key in self._lru}"
                    )
            if any(self._entries.get(k) is not e for k, e in self._lru.items()):
                raise AssertionError("LRU holds an entry that is not indexed")
            if len(owner) + self._pool.num_free != self.num_blocks:
                raise AssertionError(
                    f"{len(owner)} owned + {self._pool.num_free} free != {self.num_blocks} blocks"
                )
