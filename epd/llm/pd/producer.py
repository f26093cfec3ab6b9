"""Prefill role: hand a finished prefill's KV blocks to a decode engine.

Invariants:
- The KV cache tensor is registered once, at start, as pool `KV_POOL` with the engine's
  shared transfer engine (`TransferHub`); decode engines read it after the HTTP handshake
  (`POST /v1/transfer/connect`).
- `hand_over` (engine thread) puts one `KVBlockManager.hold` on the sequence's prompt
  blocks (prefix-cache hits included: they are migrated like any other block) and grants
  one lease on that hold; the sequence itself then ends (TO_BE_MIGRATED -> ENDED) and
  its table refs are dropped, so the hold is the only thing keeping the blocks.
- A lease ends exactly once: by the decode engine's ZMQ ack, by `release` (the proxy's
  `POST /v1/prefill/release`), or by expiry after `lease_seconds`. Acks and HTTP
  releases arrive on other threads: they end the lease at once (LeaseTable is
  thread-safe) and queue its hold; the engine thread releases queued holds and expired
  leases in `advance()` (the block manager is not thread-safe).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from epd.mmcache.leases import LeaseTable

logger = logging.getLogger(__name__)

KV_POOL = "kv_cache"


def kv_layout_of(layout: Any) -> dict[str, Any]:
    """The `MigrationRequest.kv_layout` of a `CacheLayout` (what both peers must share)."""
    return {
        "num_layers": layout.num_layers,
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "dtype": layout.dtype,
        "block_size": layout.block_size,
        "block_nbytes": layout.block_nbytes,
    }


class PDProducer:
    def __init__(self, config: Any, blocks: Any, kv_tensor: Any, layout: Any, hub: Any,
                 *, notify: Callable[[], None] = lambda: None) -> None:
        from epd.transfer import AckListener

        self.config = config
        self.blocks = blocks
        self.layout = layout
        self.hub = hub
        self._notify = notify
        self.leases: LeaseTable[str] = LeaseTable()  # payload: the hold id
        self._lock = threading.Lock()
        self._to_release: list[str] = []
        hub.register_pool(KV_POOL, kv_tensor)
        self.acks = AckListener(config.transfer_host, on_ack=self._on_ack)
        self.counts = {"handovers": 0, "released": 0, "expired": 0, "blocks_handed": 0}

    # -- engine thread ---------------------------------------------------------------
    def hand_over(self, seq: Any) -> Any:
        """Hold `seq`'s prompt blocks under a new lease; the MigrationRequest for them.
        The caller ends the sequence afterwards (Scheduler.hand_over)."""
        from epd.protocol import MigrationRequest
        from epd.protocol.wire import MMSpanRef  # not re-exported yet (test_public_api)

        n = self.blocks.blocks_needed(seq.num_prompt_tokens)
        block_ids = self.blocks.block_table(seq.request_id)[:n]
        hold = self.blocks.hold(block_ids)
        lease = self.leases.grant(hold, self.config.lease_seconds, holder=seq.request_id)
        try:
            lp = seq.logprobs[0] if seq.logprobs else None
            mr = MigrationRequest(
                engine_id=self.hub.transfer.engine_id, engine_url=self.config.public_url,
                transfer_backend=self.hub.transfer.name, pool_name=KV_POOL,
                ack_address=self.acks.address, lease_id=lease.lease_id, block_ids=block_ids,
                block_size=self.layout.block_size, num_tokens=seq.num_prompt_tokens,
                first_token=seq.output_token_ids[0],
                first_token_logprob=None if lp is None else lp.logprob,
                first_token_top_logprobs=[] if lp is None else list(lp.top),
                kv_layout=kv_layout_of(self.layout),
                prompt_token_ids=list(seq.prompt_token_ids),
                mm_spans=[MMSpanRef(offset=m.offset, length=m.length, mm_hash=m.mm_hash)
                          for m in seq.mm_items],
                num_cached_tokens=seq.num_cached_tokens, lease_expires_at=lease.expires_at,
            )  # fmt: skip
        except BaseException:
            self.leases.release(lease.lease_id)
            self.blocks.release(hold)
            raise
        self.counts["handovers"] += 1
        self.counts["blocks_handed"] += len(block_ids)
        return mr

    def advance(self) -> None:
        """Release the holds of ended leases (acked, released or expired now)."""
        expired = self.leases.expire()
        for lease in expired:
            logger.warning("KV lease %s of %s expired without an ack; freeing %s",
                           lease.lease_id, lease.holder, "its blocks")
        with self._lock:
            holds, self._to_release = self._to_release, []
            self.counts["expired"] += len(expired)
        for hold in [*holds, *(lease.payload for lease in expired)]:
            self.blocks.release(hold)

    def has_work(self) -> bool:
        with self._lock:
            if self._to_release:
                return True
        deadline = self.leases.next_deadline()
        return deadline is not None and deadline <= time.monotonic()

    def seconds_to_next_expiry(self) -> float | None:
        deadline = self.leases.next_deadline()
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    # -- any thread ------------------------------------------------------------------
    def release(self, lease_ids: list[str]) -> int:
        """End these leases now (unknown / ended ids are ignored); how many were live."""
        holds = [h for h in (self.leases.release(lid) for lid in lease_ids) if h is not None]
        if holds:
            with self._lock:
                self._to_release.extend(holds)
                self.counts["released"] += len(holds)
            self._notify()
        return len(holds)

    def _on_ack(self, ack: Any) -> None:
        n = self.release(list(ack.lease_ids))
        if not ack.ok:
            logger.info("decode engine %s gave up leases %s: %s", ack.consumer_id,
                        ack.lease_ids, ack.detail)
        logger.debug("ack from %s released %d of %d leases", ack.consumer_id, n,
                     len(ack.lease_ids))

    def stats(self) -> dict[str, int]:
        with self._lock:
            pending = len(self._to_release)
            counts = dict(self.counts)
        return {
            "pd_leases_active": len(self.leases) + pending,
            "pd_leases_expired": counts["expired"],
            "pd_handovers": counts["handovers"],
        }

    def close(self) -> None:
        self.acks.close()
