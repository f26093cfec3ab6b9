"""Paged KV cache layout: one tensor, a block's bytes contiguous, write/gather roundtrip."""

from __future__ import annotations

import pytest
import torch

from epd.llm.config import CacheLayout, EngineConfig
from epd.llm.kv_cache import PagedKVCache, num_blocks_for_budget


def make_cache(num_blocks=6, block_size=4, layers=2, kv_heads=2, head_dim=8):
    layout = CacheLayout(num_blocks, block_size, layers, kv_heads, head_dim, "float32", 64)
    return PagedKVCache(layout)


def test_one_contiguous_tensor_with_contiguous_blocks():
    cache = make_cache()
    t = cache.tensor
    assert t.is_contiguous() and t.shape == (6, 2, 2, 2, 4, 8)  # head-major blocks
    assert cache.block_nbytes == 2 * 2 * 4 * 2 * 8 * 4 == cache.layout.block_nbytes
    assert cache.block_range(3) == (3 * cache.block_nbytes, cache.block_nbytes)
    # Block 3's bytes (all layers, K and V) are exactly one range of the flat storage.
    flat = t.view(-1)
    per_block = cache.block_nbytes // 4
    t[3].fill_(1.0)
    assert flat[3 * per_block : 4 * per_block].eq(1).all()
    assert flat.sum().item() == per_block


def test_write_then_gather_roundtrip_per_layer():
    cache = make_cache()
    torch.manual_seed(0)
    # A sequence of 6 tokens in blocks [4, 1]: slots 16..19 then 4..5.
    k = torch.randn(6, 2, 8)
    v = torch.randn(6, 2, 8)
    blocks = torch.tensor([4, 4, 4, 4, 1, 1])
    offsets = torch.tensor([0, 1, 2, 3, 0, 1])
    cache.write(1, blocks, offsets, k, v)
    gk, gv = cache.read_tokens(1, [4, 1], 6)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    other_k, _ = cache.read_tokens(0, [4, 1], 6)
    assert other_k.abs().sum() == 0  # layer 0 untouched
    padded_k, _ = cache.gather(1, torch.tensor([[4, 1], [1, 0]]))
    assert padded_k.shape == (2, 8, 2, 8)
    assert torch.equal(padded_k[1, :2], k[4:6])


def test_memory_budget_and_config_validation():
    assert num_blocks_for_budget(10_000, 1000) == 10
    with pytest.raises(ValueError):
        num_blocks_for_budget(10, 1000)
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(model_dir="x", block_size=0)
    with pytest.raises(ValueError, match="vision"):
        EngineConfig(model_dir="x", vision="remote")
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model_dir="x", attention_backend="tpu")
    cfg = EngineConfig(model_dir="x", device="cpu")
    assert cfg.resolved_dtype() == "float32" and cfg.resolved_attention_backend() == "cpu"


def test_gather_rows_gives_attention_layout_for_any_layer():
    cache = make_cache(num_blocks=6, block_size=4, layers=3, kv_heads=2, head_dim=8)
    torch.manual_seed(1)
    k, v = torch.randn(7, 2, 8), torch.randn(7, 2, 8)
    blocks = torch.tensor([5, 5, 5, 5, 2, 2, 2])
    offsets = torch.tensor([0, 1, 2, 3, 0, 1, 2])
    cache.write(2, blocks, offsets, k, v)
    # layer() views write through to the head-major storage.
    k_view, _ = cache.layer(2)
    assert torch.equal(k_view[5, 1], k[1]) and torch.equal(cache.tensor[2, 2, 1, 1, :3], v[4:, 1])
    tables = torch.tensor([[5, 2], [2, 0]])
    rows = cache.row_index(tables)
    assert rows.shape == (2, 2, 2, 2)
    gk, gv = cache.gather_rows(2, rows)
    assert gk.shape == (2, 2, 8, 8) and gk.is_contiguous() and gv.is_contiguous()
    assert torch.equal(gk[0, :, :7], k.transpose(0, 1)) and torch.equal(gv[0, :, :7], v.transpose(0, 1))
    assert torch.equal(gk[1, :, :3], k[4:].transpose(0, 1))
    other_k, _ = cache.gather_rows(1, rows)  # same rows, another layer: untouched
    assert other_k.abs().sum() == 0
    tk, tv = cache.gather(2, tables)
    assert torch.equal(tk, gk.transpose(1, 2)) and torch.equal(tv, gv.transpose(1, 2))
