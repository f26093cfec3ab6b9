"""Gather + attention over paged KV (shared by the cpu and cuda backends).

Decodes are batched: one attention call per group of decoding sequences of similar
context length, over their padded gathered keys with a key-padding mask. K/V are
gathered once per layer and group, already in attention layout `[B, kv_heads, S,
head_dim]` (`PagedKVCache.gather_rows`, K and V in one copy). Each prefill chunk is one
SDPA call: plain causal over its own new K/V when nothing is cached, else over the
gathered prefix + chunk with an explicit causal mask offset by the cached length.

`_decode` is the per-group decode kernel: torch SDPA here (flash kernels on GPU); the
CPU backend overrides it (see `cpu.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from epd.llm.attention.base import AttentionBackend
from epd.llm.attention.metadata import AttentionMetadata, DecodeGroup


class GatherSDPABackend(AttentionBackend):
    name = "sdpa"

    def forward(self, layer_idx, query, key, value, meta: AttentionMetadata, scaling):
        cache = meta.kv_cache
        cache.write(layer_idx, meta.slot_blocks, meta.slot_offsets, key, value)
        gqa = query.shape[1] != key.shape[1]
        out = torch.empty_like(query)
        for d in meta.decodes:
            k, v = cache.gather_rows(layer_idx, d.kv_rows)  # [B, kvh, S, hd]
            q = query[d.start : d.end]  # [B, H, hd]
            out[d.start : d.end] = self._decode(q, k.to(q.dtype), v.to(q.dtype), d, scaling)
        for p in meta.prefills:
            q = query[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, H, L, hd]
            if p.key_mask is None:
                k = key[p.start : p.end].transpose(0, 1).unsqueeze(0)
                v = value[p.start : p.end].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
            else:
                ctx = p.key_mask.shape[1]
                k, v = cache.gather_rows(layer_idx, p.kv_rows)  # [1, kvh, n * bs, hd]
                k = k[:, :, :ctx].to(q.dtype)
                v = v[:, :, :ctx].to(q.dtype)
                o = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=p.key_mask, scale=scaling, enable_gqa=gqa
                )
            out[p.start : p.end] = o[0].transpose(0, 1)
        return out

    def _decode(
        self,
        q: torch.Tensor,  # [B, H, hd]
        k: torch.Tensor,  # [B, kvh, S, hd]
        v: torch.Tensor,
        group: DecodeGroup,
        scaling: float | None,
    ) -> torch.Tensor:  # [B, H, hd]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), k, v, attn_mask=group.key_mask, scale=scaling,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return o.squeeze(2)
