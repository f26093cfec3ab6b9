"""A safetensors writer that 64-byte-aligns tensor data in the file.

transformers memory-maps checkpoints, so a tensor's address inside the file decides its
alignment in memory, and CPU conv/matmul kernels pick different (equally valid) code
paths for misaligned weights, changing the last bits of results. With aligned data the
reference model computes exactly what a loader that copies weights computes. The file is
standard safetensors: the JSON header is padded with spaces and tensors whose byte size
is not a multiple of 64 (e.g. int64 BatchNorm counters) are stored last.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

_ALIGN = 64
_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.bool: "BOOL", torch.uint8: "U8"}


def save_aligned(state: dict[str, torch.Tensor], path: str | Path,
                 metadata: dict[str, str] | None = None) -> None:
    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    names = sorted(state, key=lambda k: (nbytes(state[k]) % _ALIGN != 0, k))
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name in names:
        t = state[name]
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes(t)]}
        offset += nbytes(t)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-(8 + len(raw))) % _ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in names:
            t = state[name].detach().contiguous().cpu()
            f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
