"""CUDA attention backend.

Same gather + SDPA algorithm as the CPU backend, run on the GPU (torch picks the flash /
memory-efficient SDPA kernels). It needs the KV cache and activations on a CUDA device.
"""

from __future__ import annotations

from epd.llm.attention.sdpa import GatherSDPABackend


class CUDAAttentionBackend(GatherSDPABackend):
    name = "cuda"

    def forward(self, layer_idx, query, key, value, meta, scaling):
        if not query.is_cuda:
            raise RuntimeError("the cuda attention backend needs tensors on a CUDA device")
        return super().forward(layer_idx, query, key, value, meta, scaling)
