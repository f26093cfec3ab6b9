"""CPU attention backend: gather + torch SDPA (see `sdpa.py`)."""

from __future__ import annotations

from epd.llm.attention.sdpa import GatherSDPABackend


class CPUAttentionBackend(GatherSDPABackend):
    name = "cpu"
