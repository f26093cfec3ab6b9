"""The bridge into transformers: attention implementation "epd_paged".

Verified on transformers 5.23: `LlamaModel.forward(**kwargs)` / `Qwen2Model.forward`
pass unknown keyword arguments through the decoder layers to the attention function, so
the engine passes `epd_attn_metadata=AttentionMetadata` with the forward call. For an
attention implementation that is not in `AttentionMaskInterface`, `create_causal_mask`
returns None, so no dense mask is built (causality comes from our metadata).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "epd_paged"


def epd_paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, hd]
    key: torch.Tensor,  # [1, kvh, T, hd]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    epd_attn_metadata=None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    meta = epd_attn_metadata
    if meta is None:
        raise RuntimeError("epd_paged attention called without epd_attn_metadata")
    if sliding_window is not None:
        raise NotImplementedError("sliding-window attention is not supported by epd_paged")
    if query.shape[0] != 1:
        raise ValueError("epd_paged expects a packed batch (batch size 1)")
    out = meta.backend.forward(
        module.layer_idx,
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        meta,
        scaling,
    )
    return out.unsqueeze(0), None  # [1, T, H, hd] as transformers expects


def register() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, epd_paged_attention)
