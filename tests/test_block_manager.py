from __future__ import annotations

import subprocess
import sys

import pytest
from helpers.checked import Checked

from epd.llm.block_manager import (
    AllocResult,
    KVBlockManager,
    MMSpanHash,
    PrefixCacheStats,
    hash_block_tokens,
)

BS = 4


def make_manager(num_blocks: int = 8, block_size: int = BS, prefix: bool = True):
    mgr = KVBlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    mgr.check_integrity()
    return Checked(mgr)


def free_order(m) -> list[int]:
    return list(m.target._free)


SYS = list(range(1, 9))  # a two-block "system prompt"


def test_allocation_order_and_growth():
    m = make_manager()
    assert m.allocate("a", 10) == AllocResult([0, 1, 2], 0)
    assert m.allocate("b", 4) == AllocResult([3], 0)
    assert m.append_slots("b", 5) is True
    assert m.block_table("b") == [3, 4]
    assert m.append_slots("a", 12) is True
    assert m.block_table("a") == [0, 1, 2]
    assert m.append_slots("a", 13) is True
    assert m.block_table("a") == [0, 1, 2, 5]
    assert (m.num_free_blocks, m.num_used_blocks, m.num_blocks) == (2, 6, 8)
    assert m.usage == pytest.approx(0.75)
    assert m.has("a") and not m.has("zzz")
    with pytest.raises(ValueError, match="already"):
        m.allocate("a", 3)
    with pytest.raises(ValueError):
        m.allocate("c", 0)


def test_all_or_nothing():
    m = make_manager()
    assert m.allocate("a", 28).block_ids == [0, 1, 2, 3, 4, 5, 6]
    assert m.allocate("b", 5) is None
    assert not m.has("b") and m.num_free_blocks == 1
    assert m.allocate("b", 4).block_ids == [7]
    assert m.append_slots("b", 5) is False
    assert m.block_table("b") == [7]
    assert m.allocate_blocks("c", 1) is None and not m.has("c")
    assert m.append_slots("a", 28) is True  # no growth needed


def test_free_order_and_reuse_without_prefix_cache():
    m = make_manager(prefix=False)
    m.allocate("a", 10)
    m.allocate("b", 4)
    m.free("a")
    assert free_order(m) == [0, 1, 2, 4, 5, 6, 7]
    m.free("a")  # idempotent
    assert m.allocate("c", 8).block_ids == [0, 1]
    m.free("b")
    assert free_order(m) == [3, 2, 4, 5, 6, 7]
    assert m.allocate("d", 9, hash_block_tokens(list(range(9)), BS)) == AllocResult([3, 2, 4], 0)
    assert m.prefix_cache_stats == PrefixCacheStats(0, 0)


def test_prefix_cache_hit_shared_system_prompt():
    m = make_manager()
    toks_a = SYS + [100, 101, 102, 103, 104, 105]
    ha = hash_block_tokens(toks_a, BS)
    assert len(ha) == 3  # full blocks only
    assert m.allocate("a", len(toks_a), ha) == AllocResult([0, 1, 2, 3], 0)
    m.cache_blocks("a", ha, 14)
    m.cache_blocks("a", ha, 14)  # idempotent
    assert m.num_cached_blocks == 3
    toks_b = SYS + [200, 201, 202, 203]
    hb = hash_block_tokens(toks_b, BS)
    assert hb[:2] == ha[:2] and hb[2] != ha[2]
    assert m.allocate("b", len(toks_b), hb) == AllocResult([0, 1, 4], 8)
    assert m.prefix_cache_stats == PrefixCacheStats(queries=3 + 2, hits=2)
    m.free("a")
    # shared blocks 0,1 still held by b; a's partial tail 3 to the front, hashed 2 to the back
    assert free_order(m) == [3, 5, 6, 7, 2]
    m.free("b")
    assert free_order(m) == [4, 3, 5, 6, 7, 2, 1, 0]


def test_never_the_whole_prompt_is_cached():
    m = make_manager()
    h = hash_block_tokens(SYS, BS)
    m.allocate("a", 8, h)
    m.cache_blocks("a", h, 8)
    m.free("a")
    # 8 tokens = 2 full cached blocks, but the last token must be computed: 1 hit
    assert m.allocate("b", 8, h) == AllocResult([0, 2], 4)
    assert m.block_table("b") == [0, 2]
    # one more token: both blocks hit
    m.free("b")
    h9 = hash_block_tokens(SYS + [9], BS)
    assert m.allocate("c", 9, h9) == AllocResult([0, 1, 2], 8)


def test_lru_eviction_keeps_prefixes_longest():
    m = make_manager()
    toks = SYS + [50, 51, 52, 53, 54]
    h = hash_block_tokens(toks, BS)
    m.allocate("a", len(toks), h)  # [0, 1, 2, 3]
    m.cache_blocks("a", h, len(toks))
    m.free("a")
    assert free_order(m) == [3, 4, 5, 6, 7, 2, 1, 0]
    assert m.num_free_blocks == 8 and m.num_used_blocks == 0
    assert m.allocate("c", 24).block_ids == [3, 4, 5, 6, 7, 2]
    assert m.target.num_evictions == 1 and m.num_cached_blocks == 2
    # hits 0 and 1 would leave no free block for the 2 fresh ones: nothing changes
    assert m.allocate("d", len(toks), h) is None
    assert free_order(m) == [1, 0] and m.num_cached_blocks == 2
    m.free("c")  # unhashed blocks go to the front, in table order
    assert free_order(m) == [3, 4, 5, 6, 7, 2, 1, 0]
    assert m.allocate("d", len(toks), h) == AllocResult([0, 1, 3, 4], 8)
    assert m.prefix_cache_stats == PrefixCacheStats(queries=3 + 3, hits=2)


def test_revived_blocks_count_against_free():
    m = make_manager(num_blocks=3)
    h = hash_block_tokens(SYS, BS)
    m.allocate("a", 8, h)
    m.cache_blocks("a", h, 8)
    m.free("a")
    assert free_order(m) == [2, 1, 0]
    # 10 tokens: hit 0,1 (both free -> revived) + 1 fresh = 3 blocks: exactly fits
    assert m.allocate("b", 10, hash_block_tokens(SYS + [9, 9], BS)) == AllocResult([0, 1, 2], 8)
    m.free("b")
    # 13 tokens would need 2 fresh blocks after reviving 2: impossible, nothing changes
    before = free_order(m)
    assert m.allocate("c", 13, hash_block_tokens(SYS + [7] * 5, BS)) is None
    assert free_order(m) == before and m.prefix_cache_stats == PrefixCacheStats(
        queries=1 + 2, hits=2
    )


def test_image_hashes_change_the_chain():
    toks = [5] * 4 + [32000] * 6 + [7] * 6  # image placeholders at 4..9
    plain = hash_block_tokens(toks, BS)
    cat = hash_block_tokens(toks, BS, [MMSpanHash(4, 6, "cat")])
    dog = hash_block_tokens(toks, BS, [MMSpanHash(4, 6, "dog")])
    assert len(plain) == len(cat) == len(dog) == 4
    assert plain[0] == cat[0] == dog[0]  # block before the image
    for i in 1, 2, 3:  # overlapping blocks, and everything after (chained)
        assert len({plain[i], cat[i], dog[i]}) == 3
    # the same image placed at a different offset hashes differently
    shifted = hash_block_tokens(toks, BS, [MMSpanHash(5, 5, "cat")])
    assert shifted[1] != cat[1]
    # two images vs one: the second span changes only blocks from its start
    two = hash_block_tokens(toks, BS, [MMSpanHash(12, 2, "dog"), MMSpanHash(4, 6, "cat")])
    assert two[:3] == cat[:3] and two[3] != cat[3]
    m = make_manager()
    m.allocate("a", len(toks), cat)
    m.cache_blocks("a", cat, len(toks))
    m.free("a")
    assert m.allocate("b", len(toks), dog).num_cached_tokens == 4
    assert m.allocate("c", len(toks), cat).num_cached_tokens == 12


def test_hashing_incremental_and_deterministic_across_processes():
    toks = list(range(30))
    spans = [MMSpanHash(6, 9, "img-x")]
    full = hash_block_tokens(toks, BS, spans)
    assert len(full) == 7
    assert hash_block_tokens(toks[:13], BS, spans) == full[:3]
    assert hash_block_tokens(toks, BS, spans, full[2], start_block=3) == full[3:]
    assert all(isinstance(h, bytes) and len(h) == 32 for h in full)
    code = (
        "from epd.llm.block_manager import hash_block_tokens as h, MMSpanHash as M;"
        "print(h(list(range(30)), 4, [M(6, 9, 'img-x')])[-1].hex())"
    )
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.strip() == full[-1].hex()


def test_cache_blocks_only_full_computed_and_duplicates():
    m = make_manager()
    toks = SYS + [9, 9, 9, 9]
    h = hash_block_tokens(toks, BS)
    m.allocate("a", 12, h)
    m.allocate("b", 12, h)  # computed concurrently: no hits yet
    assert m.block_table("b") == [3, 4, 5]
    m.cache_blocks("a", h, 7)  # only block 0 is fully computed
    assert m.num_cached_blocks == 1
    m.cache_blocks("a", h, 12)
    m.cache_blocks("b", h, 12)  # hashes owned by a's blocks: b's stay uncached
    assert m.num_cached_blocks == 3
    m.free("b")
    assert free_order(m) == [3, 4, 5, 6, 7]
    with pytest.raises(RuntimeError, match="another hash"):
        m.cache_blocks("a", hash_block_tokens([0] * 12, BS), 12)


def test_hold_release_for_pd_migration():
    m = make_manager()
    m.allocate("p", 10)
    hold = m.hold(m.block_table("p"))
    m.free("p")
    assert m.num_used_blocks == 3 and not m.has("p")
    assert m.allocate("q", 20).block_ids == [3, 4, 5, 6, 7]
    assert m.allocate("r", 1) is None
    assert m.release(hold) is True
    assert m.release(hold) is False
    assert free_order(m) == [0, 1, 2]
    with pytest.raises(ValueError, match="allocated"):
        m.hold([0])
    with pytest.raises(ValueError):
        m.hold([99])


def test_allocate_blocks_for_migration_target():
    m = make_manager()
    m.allocate("x", 4)
    assert m.allocate_blocks("d", 3) == [1, 2, 3]
    assert m.allocate_blocks("d", 0) == []
    assert m.allocate_blocks("d", 1) == [4]
    assert m.block_table("d") == [1, 2, 3, 4]
    assert m.append_slots("d", 17) is True
    assert m.block_table("d") == [1, 2, 3, 4, 5]
    assert m.allocate_blocks("e", 3) is None and not m.has("e")


def test_prefix_caching_disabled():
    m = make_manager(prefix=False)
    h = hash_block_tokens(SYS + [1], BS)
    m.allocate("a", 9, h)
    m.cache_blocks("a", h, 9)
    assert m.num_cached_blocks == 0
    m.free("a")
    assert m.allocate("b", 9, h) == AllocResult([0, 1, 2], 0)


def test_reset_prefix_cache():
    m = make_manager()
    h = hash_block_tokens(SYS + [1], BS)
    m.allocate("a", 9, h)
    m.cache_blocks("a", h, 9)
    assert m.reset_prefix_cache() is False  # blocks in use
    m.free("a")
    assert m.reset_prefix_cache() is True
    assert m.num_cached_blocks == 0 and m.prefix_cache_stats == PrefixCacheStats(0, 0)
    assert m.allocate("b", 9, h).num_cached_tokens == 0


def test_check_integrity_detects_corruption():
    mgr = KVBlockManager(4, BS)
    mgr.allocate("a", 5)
    mgr.check_integrity()
    mgr._blocks[0].ref_cnt += 1
    with pytest.raises(AssertionError, match="block 0"):
        mgr.check_integrity()
    mgr._blocks[0].ref_cnt -= 1
    mgr._free[1] = None
    with pytest.raises(AssertionError, match="block 1"):
        mgr.check_integrity()
    del mgr._free[1]
    mgr._blocks[2].block_hash = b"x" * 32
    with pytest.raises(AssertionError, match="block 2"):
        mgr.check_integrity()
