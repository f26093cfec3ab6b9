"""Paged attention: backends vs naive attention, and the transformers bridge vs sdpa."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaModel

from epd.llm.attention import (
    ATTN_IMPLEMENTATION,
    BatchEntry,
    available_backends,
    build_attention_metadata,
    get_backend,
)
from epd.llm.config import CacheLayout
from epd.llm.kv_cache import PagedKVCache
from epd.llm.positions import packed_positions

BS = 4


def naive(q, k, v, num_cached):
    """q [L, H, D], k/v [ctx, KVH, D]: causal attention with a cached prefix."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    L, ctx = q.shape[0], k.shape[0]
    mask = torch.arange(ctx)[None, :] <= (torch.arange(L)[:, None] + num_cached)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def make_cache(layers=1, kv_heads=2, head_dim=8, num_blocks=16):
    return PagedKVCache(CacheLayout(num_blocks, BS, layers, kv_heads, head_dim, "float32", 64))


def test_registry():
    assert {"cpu", "cuda"} <= set(available_backends())
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("nope")


def test_cpu_backend_matches_naive_for_mixed_packed_batch():
    torch.manual_seed(0)
    cache = make_cache()
    backend = get_backend("cpu")
    H, KVH, D = 4, 2, 8
    # Sequences: (block table, total tokens, tokens already cached before this step)
    seqs = [([3, 7], 6, 5), ([0], 3, 2), ([1, 2, 5], 11, 4), ([9, 8], 7, 0)]
    full_k = [torch.randn(n, KVH, D) for _, n, _ in seqs]
    full_v = [torch.randn(n, KVH, D) for _, n, _ in seqs]
    full_q = [torch.randn(n, H, D) for _, n, _ in seqs]
    # Put the cached prefixes into the cache first.
    for (table, _, c), k, v in zip(seqs, full_k, full_v, strict=True):
        if c:
            blocks = torch.tensor([table[p // BS] for p in range(c)])
            cache.write(0, blocks, torch.arange(c) % BS, k[:c], v[:c])
    entries = [BatchEntry(t, c, n - c) for t, n, c in seqs]
    meta = build_attention_metadata(entries, BS, cache, backend, "cpu")
    assert meta.num_decode_tokens == 2 and len(meta.prefills) == 2
    q = torch.cat([fq[c:] for fq, (_, _, c) in zip(full_q, seqs, strict=True)])
    k = torch.cat([fk[c:] for fk, (_, _, c) in zip(full_k, seqs, strict=True)])
    v = torch.cat([fv[c:] for fv, (_, _, c) in zip(full_v, seqs, strict=True)])
    out = backend.forward(0, q, k, v, meta, D**-0.5)
    start = 0
    for (_, n, c), fq, fk, fv in zip(seqs, full_q, full_k, full_v, strict=True):
        expect = naive(fq[c:], fk, fv, c)
        torch.testing.assert_close(out[start : start + n - c], expect, atol=1e-5, rtol=1e-5)
        start += n - c


def test_decode_groups_bound_padding():
    from epd.llm.attention.metadata import _decode_groups

    assert _decode_groups([1, 1, 1]) == [(0, 3)]
    assert _decode_groups([1, 1, 2, 2, 2, 3, 3, 9, 9, 10]) == [(0, 2), (2, 7), (7, 10)]
    cache = make_cache()
    entries = [BatchEntry([i], 0, 1) for i in range(5)] + [BatchEntry([5, 6, 7, 8], 12, 1)]
    meta = build_attention_metadata(entries, BS, cache, get_backend("cpu"), "cpu")
    assert [(g.start, g.end) for g in meta.decodes] == [(0, 5), (5, 6)]
    assert meta.decodes[0].block_tables.tolist() == [[0], [1], [2], [3], [4]]
    assert meta.decodes[1].block_tables.tolist() == [[5, 6, 7, 8]]
    assert meta.decodes[1].key_mask[:, 0, 0].sum(-1).tolist() == [13]
    unsorted = [BatchEntry([5, 6, 7, 8], 12, 1), BatchEntry([0], 0, 1)]
    meta = build_attention_metadata(unsorted, BS, cache, get_backend("cpu"), "cpu")
    assert [(g.start, g.end) for g in meta.decodes] == [(0, 1), (1, 2)]


def test_single_token_entries_must_come_first():
    cache = make_cache()
    with pytest.raises(ValueError, match="first"):
        build_attention_metadata(
            [BatchEntry([0, 1], 0, 5), BatchEntry([2], 3, 1)], BS, cache, get_backend("cpu"), "cpu"
        )


def test_positions():
    assert packed_positions([(5, 1), (2, 1)]).tolist() == [[5, 2]]
    assert packed_positions([(3, 1), (0, 3)]).tolist() == [[3, 0, 1, 2]]


def test_hf_llama_with_epd_paged_matches_sdpa_chunked_and_decode():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=128,
    )
    ref = LlamaModel(cfg).eval()
    cfg_paged = LlamaConfig(**cfg.to_dict())
    cfg_paged._attn_implementation = ATTN_IMPLEMENTATION
    paged = LlamaModel(cfg_paged).eval()
    paged.load_state_dict(ref.state_dict())
    cache = make_cache(layers=2, kv_heads=2, head_dim=8)
    backend = get_backend("cpu")
    a = torch.randint(0, 64, (13,))
    b = torch.randint(0, 64, (6,))
    with torch.inference_mode():
        want_a = ref(input_ids=a[None], use_cache=False).last_hidden_state[0]
        want_b = ref(input_ids=b[None], use_cache=False).last_hidden_state[0]
        tables = {"a": [0, 1, 2, 3], "b": [4, 5]}
        # Steps: a[0:5] + b[0:5] ; a[5:12] ; then decodes a[12], b[5] in one packed batch.
        plan = [[("a", 0, 5), ("b", 0, 5)], [("a", 5, 7)], [("a", 12, 1), ("b", 5, 1)]]
        got = {"a": [], "b": []}
        toks = {"a": a, "b": b}
        for step in plan:
            step = sorted(step, key=lambda e: e[2] != 1)
            ids = torch.cat([toks[r][c : c + n] for r, c, n in step])
            entries = [BatchEntry(tables[r], c, n) for r, c, n in step]
            meta = build_attention_metadata(entries, BS, cache, backend, "cpu")
            pos = packed_positions([(c, n) for _, c, n in step])
            hid = paged(input_ids=ids[None], position_ids=pos, use_cache=False,
                        epd_attn_metadata=meta).last_hidden_state[0]
            off = 0
            for r, _, n in step:
                got[r].append(hid[off : off + n])
                off += n
    torch.testing.assert_close(torch.cat(got["a"]), want_a, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat(got["b"]), want_b, atol=1e-5, rtol=1e-4)


def test_cpu_decode_kernel_matches_sdpa_backend_with_padded_group():
    from epd.llm.attention.sdpa import GatherSDPABackend

    torch.manual_seed(2)
    cache = make_cache(num_blocks=12)
    H, KVH, D = 4, 2, 8
    # Three decodes in one group (2-3 blocks of 4): contexts 6, 9 and 11 tokens, so the
    # shorter ones are padded; padded slots hold garbage that must weigh exactly 0.
    seqs = [([3, 7], 6), ([0, 4, 6], 9), ([1, 2, 5], 11)]
    cache.tensor.normal_()
    fulls = []
    for table, n in seqs:
        k, v = torch.randn(n, KVH, D), torch.randn(n, KVH, D)
        blocks = torch.tensor([table[p // BS] for p in range(n - 1)])
        cache.write(0, blocks, torch.arange(n - 1) % BS, k[:-1], v[:-1])
        fulls.append((k, v))
    entries = [BatchEntry(t, n - 1, 1) for t, n in seqs]
    meta = build_attention_metadata(entries, BS, cache, get_backend("cpu"), "cpu")
    assert len(meta.decodes) == 1 and meta.decodes[0].kv_rows.shape == (2, 3, KVH, 3)
    assert meta.decodes[0].key_bias.isinf().sum() == 3 * 12 - (6 + 9 + 11)
    q = torch.randn(3, H, D)
    k_new = torch.stack([k[-1] for k, _ in fulls])
    v_new = torch.stack([v[-1] for _, v in fulls])
    saved = cache.tensor.clone()
    out_cpu = get_backend("cpu").forward(0, q, k_new, v_new, meta, D**-0.5)
    cache.tensor.copy_(saved)
    out_sdpa = GatherSDPABackend().forward(0, q, k_new, v_new, meta, D**-0.5)
    for i, (k, v) in enumerate(fulls):
        expect = naive(q[i : i + 1], k, v, k.shape[0] - 1)
        torch.testing.assert_close(out_cpu[i : i + 1], expect, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_cpu, out_sdpa, atol=1e-5, rtol=1e-5)


def test_block_tables_longer_than_the_context_are_cut():
    """A sequence may hold blocks beyond its context (PD reserves the full length):
    metadata must use only the blocks covering the context, for decodes and prefills."""
    cache = make_cache()
    backend = get_backend("cpu")
    # Two decodes in one group (contexts 6 and 10: 2 and 3 blocks) and one prefill.
    exact = [BatchEntry([0, 1], 5, 1), BatchEntry([2, 3, 4], 9, 1), BatchEntry([5, 6], 2, 3)]
    longer = [BatchEntry([0, 1, 9, 10], 5, 1), BatchEntry([2, 3, 4, 11], 9, 1),
              BatchEntry([5, 6, 12], 2, 3)]
    m_exact = build_attention_metadata(exact, BS, cache, backend, "cpu")
    m_long = build_attention_metadata(longer, BS, cache, backend, "cpu")
    assert [g.block_tables.tolist() for g in m_long.decodes] == [[[0, 1, 0], [2, 3, 4]]]
    for a, b in zip(m_exact.decodes, m_long.decodes, strict=True):
        assert torch.equal(a.block_tables, b.block_tables)
        assert torch.equal(a.key_mask, b.key_mask) and torch.equal(a.kv_rows, b.kv_rows)
    assert m_long.prefills[0].block_table.tolist() == [[5, 6]]
    assert torch.equal(m_exact.slot_blocks, m_long.slot_blocks)
