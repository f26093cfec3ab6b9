"""Position ids for a packed batch.

1-D rotary positions: token i of a sequence has position i, so a chunk covering tokens
[num_computed, num_computed + num_new) gets `arange(num_computed, num_computed + num_new)`.
Returned as `[1, T]` (transformers' position_ids for a batch of one packed row); models
with M-RoPE will return `[3, 1, T]` from a sibling function with the same inputs.
"""

from __future__ import annotations

import torch


def packed_positions(
    chunks: list[tuple[int, int]], device: torch.device | str = "cpu"
) -> torch.Tensor:
    """chunks: (num_computed, num_new) per sequence in packed order -> LongTensor [1, T]."""
    if all(n == 1 for _, n in chunks):
        return torch.tensor([[c for c, _ in chunks]], dtype=torch.long, device=device)
    parts = [torch.arange(c, c + n, dtype=torch.long) for c, n in chunks]
    return torch.cat(parts).unsqueeze(0).to(device)
