"""CPU attention backend: gather + torch SDPA for prefill (see `sdpa.py`), and a batched
matmul decode kernel.

Why not SDPA for decode: with one query per sequence, torch's CPU flash kernel is
several times slower than two batched matmuls + softmax over the gathered keys. The
query heads that share a kv head form the rows of one matmul (grouped-query attention
without repeating K/V); padded keys get a -inf bias, so they weigh exactly 0.
"""

from __future__ import annotations

import torch

from epd.llm.attention.metadata import DecodeGroup
from epd.llm.attention.sdpa import GatherSDPABackend


class CPUAttentionBackend(GatherSDPABackend):
    name = "cpu"

    def _decode(
        self,
        q: torch.Tensor,  # [B, H, hd]
        k: torch.Tensor,  # [B, kvh, S, hd]
        v: torch.Tensor,
        group: DecodeGroup,
        scaling: float | None,
    ) -> torch.Tensor:  # [B, H, hd]
        b, h, hd = q.shape
        kvh = k.shape[1]
        scale = hd**-0.5 if scaling is None else scaling
        scores = torch.matmul(q.reshape(b, kvh, h // kvh, hd), k.transpose(2, 3))
        scores.mul_(scale).add_(group.key_bias)  # [B, kvh, G, S] + [B, 1, 1, S]
        return torch.matmul(torch.softmax(scores, dim=-1), v).reshape(b, h, hd)
