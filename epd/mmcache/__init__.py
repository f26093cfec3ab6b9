"""Multimodal cache: paged image features keyed by content hash, and leases on what is
handed to other processes."""

from __future__ import annotations

from epd.mmcache.cache import MMCache, MMEntry
from epd.mmcache.leases import Lease, LeaseTable
from epd.mmcache.pool import BlockPool

__all__ = ["BlockPool", "Lease", "LeaseTable", "MMCache", "MMEntry"]
