"""LeaseTable.snapshot() and the encoder's lease/ref consistency check built on it."""

from __future__ import annotations

import threading

import pytest
import torch

from epd.encoder.cache_setup import cache_stats, check_leased_refs
from epd.mmcache import Lease, LeaseTable, MMCache


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_snapshot_is_an_ordered_copy_of_live_leases():
    clock = FakeClock()
    leases: LeaseTable[str] = LeaseTable(clock=clock, wall_clock=lambda: 7e9)
    assert leases.snapshot() == []
    a = leases.grant("A", ttl_s=5, holder="llm-0")
    b = leases.grant("B", ttl_s=1)
    c = leases.grant("C", ttl_s=3)
    snap = leases.snapshot()
    assert snap == [b, c, a]  # earliest deadline first
    assert all(isinstance(x, Lease) for x in snap)
    assert [x.deadline for x in snap] == [101.0, 103.0, 105.0]
    assert leases.release(c.lease_id) == "C"
    assert snap == [b, c, a]  # a copy: later changes do not show up in it
    snap.clear()
    assert len(leases) == 2  # and clearing the copy does not touch the table
    clock.t = 101.0
    assert leases.expire() == [b]
    assert leases.snapshot() == [a]
    assert leases.release(a.lease_id) == "A"
    assert leases.snapshot() == []


def test_snapshot_while_other_threads_grant_and_release():
    leases: LeaseTable[int] = LeaseTable()
    errors: list[BaseException] = []

    def churn(base: int) -> None:
        try:
            for i in range(300):
                lease = leases.grant(base + i, ttl_s=60)
                assert leases.release(lease.lease_id) == base + i
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(k * 1000,)) for k in range(2)]
    kept = leases.grant(-1, ttl_s=120)
    for t in threads:
        t.start()
    seen = 0
    while any(t.is_alive() for t in threads):
        snap = leases.snapshot()
        assert kept in snap and len({x.lease_id for x in snap}) == len(snap)
        seen += 1
    for t in threads:
        t.join()
    assert errors == [] and seen >= 1
    assert leases.snapshot() == [kept]


def _cache() -> MMCache:
    return MMCache(6, 4, 2, torch.float32)


def test_check_leased_refs_accepts_one_ref_per_lease():
    cache, leases = _cache(), LeaseTable()
    entry = cache.allocate("img", 6)  # 2 blocks, one ref
    cache.commit(entry, torch.ones(6, 2))
    leases.grant(entry, ttl_s=10)
    check_leased_refs(cache, leases)
    cache.acquire(entry)  # a second request for the same image: second ref, second lease
    leases.grant(entry, ttl_s=10)
    check_leased_refs(cache, leases)
    stats = cache_stats(cache)
    assert (stats["blocks_total"], stats["blocks_used"], stats["blocks_referenced"]) == (6, 2, 2)
    assert (stats["entries"], stats["block_tokens"]) == (1, 4)


def test_check_leased_refs_catches_leaks_and_lost_refs():
    cache, leases = _cache(), LeaseTable()
    leaked = cache.allocate("leak", 4)  # a ref nobody leased
    cache.commit(leaked, torch.zeros(4, 2))
    with pytest.raises(AssertionError, match="1 referenced blocks, 0 leased"):
        check_leased_refs(cache, leases)
    cache.release(leaked)
    check_leased_refs(cache, leases)
    entry = cache.allocate("img", 4)
    cache.commit(entry, torch.zeros(4, 2))
    leases.grant(entry, ttl_s=10)
    leases.grant(entry, ttl_s=10)  # two leases but only one ref
    with pytest.raises(AssertionError, match="held by 2 lease"):
        check_leased_refs(cache, leases)
