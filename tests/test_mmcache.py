from __future__ import annotations

import threading

import pytest
import torch
from helpers.checked import Checked

from epd.mmcache import BlockPool, LeaseTable, MMCache, MMEntry

BT, H = 4, 3


def make_cache(num_blocks: int = 8) -> Checked:
    return Checked(MMCache(num_blocks, BT, H, torch.float32))


def feats(num_tokens: int, base: float = 0.0) -> torch.Tensor:
    return torch.arange(num_tokens * H, dtype=torch.float32).view(num_tokens, H) + base


def ready_entry(c, mm_hash: str, num_tokens: int, release: bool = True) -> MMEntry:
    e = c.allocate(mm_hash, num_tokens)
    c.commit(e, feats(num_tokens, base=hash(mm_hash) % 100))
    if release:
        c.release(e)
    return e


def test_layout_and_exact_block_ids():
    c = make_cache()
    assert c.tensor.shape == (8, BT, H) and c.tensor.is_contiguous()
    assert c.block_nbytes == BT * H * 4
    a = c.allocate("a", 10)
    b = c.allocate("b", 4)
    d = c.allocate("d", 5)
    assert (a.block_ids, b.block_ids, d.block_ids) == ([0, 1, 2], [3], [4, 5])
    assert a.ref_count == 1 and not a.ready
    assert (c.num_used_blocks, c.num_free_blocks, c.num_referenced_blocks) == (6, 2, 6)
    assert c.num_entries == 3 and "a" in c and "zz" not in c
    with pytest.raises(ValueError, match="already"):
        c.allocate("a", 10)
    with pytest.raises(ValueError):
        c.allocate("e", 0)


def test_commit_read_roundtrip_non_adjacent_blocks():
    c = make_cache()
    x = c.allocate("x", 4)  # [0]
    y = c.allocate("y", 4)  # [1]
    c.drop(x)
    z = c.allocate("z", 10)  # lowest free ids first: [0, 2, 3]
    assert z.block_ids == [0, 2, 3]
    f = feats(10)
    c.commit(z, f)
    assert z.ready
    assert torch.equal(c.read(z), f)
    assert torch.equal(c.tensor[0], f[0:4])
    assert torch.equal(c.tensor[2], f[4:8])
    assert torch.equal(c.tensor[3, :2], f[8:10])
    out = c.read(z)
    out.zero_()  # a copy, not a view of the pool
    assert torch.equal(c.read(z), f)
    with pytest.raises(ValueError, match="already committed"):
        c.commit(z, f)
    with pytest.raises(ValueError, match="shape"):
        c.commit(y, feats(3))
    with pytest.raises(ValueError, match="not committed"):
        c.read(y)


def test_lookup_refcounts_and_stats():
    c = make_cache()
    e = c.allocate("a", 6)
    assert c.lookup("a") is None  # pending entries are not returned
    c.commit(e, feats(6))
    c.release(e)
    assert e.ref_count == 0 and c.num_referenced_blocks == 0 and c.num_used_blocks == 2
    assert c.num_evictable_blocks == 2
    got = c.lookup("a")
    assert got is e and e.ref_count == 1
    c.acquire(e)
    assert e.ref_count == 2 and c.num_evictable_blocks == 0
    c.release(e)
    c.release(e)
    with pytest.raises(ValueError, match="released more often"):
        c.release(e)
    assert c.lookup("missing") is None
    assert (c.hits, c.misses, c.evictions) == (1, 2, 0)


def test_lru_eviction_order():
    c = make_cache()
    a = ready_entry(c, "a", 8, release=False)  # [0, 1]
    b = ready_entry(c, "b", 8, release=False)  # [2, 3]
    d = ready_entry(c, "d", 8, release=False)  # [4, 5]
    for e in (b, a, d):  # least recently used first: b, a, d
        c.release(e)
    n = c.allocate("n", 12)  # needs 3 blocks, 2 free: evicts b only
    assert n.block_ids == [2, 3, 6]
    assert c.evictions == 1 and "b" not in c and "a" in c and "d" in c and b.freed
    assert c.lookup("a") is a  # touch a: d is now least recently used
    c.release(a)
    m = c.allocate("m", 4)
    assert m.block_ids == [7]
    m2 = c.allocate("m2", 4)
    assert m2.block_ids == [4] and "d" not in c and c.evictions == 2
    with pytest.raises(ValueError, match="evicted"):
        c.acquire(d)


def test_referenced_entries_are_never_evicted_and_all_or_nothing():
    c = make_cache()
    a = ready_entry(c, "a", 16, release=False)  # [0..3], referenced
    ready_entry(c, "b", 8)  # [4, 5], cached
    ready_entry(c, "d", 4)  # [6], cached
    # 5 blocks needed: 1 free + 3 evictable = 4 < 5: fails, evicts nothing
    assert c.allocate("big", 20) is None
    assert c.get_or_allocate("big", 20) is None
    assert "b" in c and "d" in c and c.evictions == 0 and c.num_entries == 3
    c.release(a)  # LRU order now b, d, a
    big = c.allocate("big", 16)  # 4 blocks: 1 free + b + d; a (used last) survives
    assert big.block_ids == [4, 5, 6, 7]
    assert "a" in c and "b" not in c and "d" not in c and c.evictions == 2


def test_get_or_allocate_single_flight_and_drop():
    c = make_cache()
    e, created = c.get_or_allocate("img", 5)
    assert created and e.ref_count == 1 and e.block_ids == [0, 1]
    w, created2 = c.get_or_allocate("img", 5)  # a second request waits on the pending one
    assert w is e and not created2 and e.ref_count == 2
    with pytest.raises(ValueError, match="5 tokens"):
        c.get_or_allocate("img", 6)
    c.drop(e)  # the encode failed: blocks are freed although the waiter holds a ref
    assert e.freed and "img" not in c and c.num_free_blocks == 8
    c.release(e)  # the waiter's release is a no-op
    c.drop(e)  # idempotent
    with pytest.raises(ValueError, match="dropped"):
        c.commit(e, feats(5))
    e2, created3 = c.get_or_allocate("img", 5)
    assert created3 and e2.block_ids == [0, 1]
    c.commit(e2, feats(5))
    with pytest.raises(ValueError, match="release it instead"):
        c.drop(e2)
    assert (c.hits, c.misses) == (1, 2)  # the mismatched ask counts as neither


def test_release_of_pending_entry_drops_it():
    c = make_cache()
    e = c.allocate("p", 4)
    c.release(e)
    assert e.freed and c.num_entries == 0 and c.num_free_blocks == 8


def test_from_memory_budget():
    c = MMCache.from_memory_budget(100, BT, H, torch.bfloat16)
    assert c.block_nbytes == BT * H * 2 and c.num_blocks == 100 // 24 == 4
    assert c.tensor.dtype == torch.bfloat16 and c.tensor.shape == (4, BT, H)
    with pytest.raises(ValueError, match="no block"):
        MMCache.from_memory_budget(10, BT, H, torch.bfloat16)


def test_block_pool():
    p = BlockPool(4)
    assert p.allocate(2) == [0, 1] and p.allocate(3) is None and p.num_free == 2
    p.free([1])
    assert p.allocate(2) == [1, 2]
    with pytest.raises(ValueError, match="twice"):
        p.free([3])  # 3 is free
    with pytest.raises(ValueError, match="range"):
        p.free([9])


def test_concurrent_get_or_allocate_commit_release():
    cache = MMCache(6, BT, H, torch.float32)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for i in range(200):
                key = f"k{(i * 7 + seed) % 5}"
                got = cache.get_or_allocate(key, 6)
                if got is None:
                    continue
                entry, created = got
                if created:
                    cache.commit(entry, feats(6))
                elif entry.ready:
                    assert torch.equal(cache.read(entry), feats(6))
                cache.release(entry)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    cache.check_integrity()
    assert cache.num_referenced_blocks == 0 and cache.hits + cache.misses == 400


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_lease_table_with_fake_clock():
    clock = FakeClock()
    leases: LeaseTable[str] = LeaseTable(clock=clock, wall_clock=lambda: 5e9)
    a = leases.grant("A", ttl_s=5, holder="llm-1")
    b = leases.grant("B", ttl_s=2)
    assert len(leases) == 2 and a.lease_id != b.lease_id and len(a.lease_id) == 32
    assert (a.deadline, a.expires_at, a.holder) == (1005.0, 5e9 + 5, "llm-1")
    assert leases.next_deadline() == 1002.0 and a.lease_id in leases
    clock.t = 1001.9
    assert leases.expire() == []
    clock.t = 1002.0
    assert [x.payload for x in leases.expire()] == ["B"]
    assert leases.release(b.lease_id) is None  # already expired
    assert leases.get(a.lease_id) is a
    assert leases.release(a.lease_id) == "A"
    assert leases.release(a.lease_id) is None  # idempotent
    assert len(leases) == 0 and leases.next_deadline() is None
    c = leases.grant("C", 3)
    d = leases.grant("D", 1)
    assert leases.expire(now=2000.0) == [d, c]  # earliest deadline first
    with pytest.raises(ValueError):
        leases.grant("E", 0)


def test_leases_release_cache_entries_on_ack_or_expiry():
    clock = FakeClock()
    c = make_cache()
    leases: LeaseTable[list[MMEntry]] = LeaseTable(clock=clock)
    e1 = ready_entry(c, "i1", 4, release=False)
    e2 = ready_entry(c, "i2", 4, release=False)
    acked = leases.grant([e1], ttl_s=10)
    leases.grant([e2], ttl_s=10)
    for entry in leases.release(acked.lease_id) or []:  # the ack
        c.release(entry)
    assert e1.ref_count == 0 and e2.ref_count == 1
    clock.t += 10
    for lease in leases.expire():  # the ack that never came
        for entry in lease.payload:
            c.release(entry)
    assert c.num_referenced_blocks == 0 and c.num_evictable_blocks == 2
