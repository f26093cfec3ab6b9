"""Gather + scaled-dot-product attention over paged KV (shared by the cpu and cuda backends).

Decodes are batched: one SDPA call per group of decoding sequences of similar context
length, over their padded gathered keys with a key-padding mask. Each prefill chunk is one SDPA call: plain causal over
its own new K/V when nothing is cached, else over the gathered prefix + chunk with an
explicit causal mask offset by the cached length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from epd.llm.attention.base import AttentionBackend
from epd.llm.attention.metadata import AttentionMetadata


class GatherSDPABackend(AttentionBackend):
    name = "sdpa"

    def forward(self, layer_idx, query, key, value, meta: AttentionMetadata, scaling):
        cache = meta.kv_cache
        cache.write(layer_idx, meta.slot_blocks, meta.slot_offsets, key, value)
        gqa = query.shape[1] != key.shape[1]
        out = torch.empty_like(query)
        for d in meta.decodes:
            k, v = cache.gather(layer_idx, d.block_tables)  # [B, S, kvh, hd]
            q = query[d.start : d.end].unsqueeze(2)  # [B, H, 1, hd]
            o = F.scaled_dot_product_attention(
                q,
                k.transpose(1, 2).to(q.dtype),
                v.transpose(1, 2).to(q.dtype),
                attn_mask=d.key_mask,
                scale=scaling,
                enable_gqa=gqa,
            )
            out[d.start : d.end] = o.squeeze(2)
        for p in meta.prefills:
            q = query[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, H, L, hd]
            if p.key_mask is None:
                k = key[p.start : p.end].transpose(0, 1).unsqueeze(0)
                v = value[p.start : p.end].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
            else:
                ctx = p.key_mask.shape[1]
                k, v = cache.gather(layer_idx, p.block_table)
                k = k[:, :ctx].transpose(1, 2).to(q.dtype)
                v = v[:, :ctx].transpose(1, 2).to(q.dtype)
                o = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=p.key_mask, scale=scaling, enable_gqa=gqa
                )
            out[p.start : p.end] = o[0].transpose(0, 1)
        return out
