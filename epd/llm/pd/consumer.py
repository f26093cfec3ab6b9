"""Decode role: pull a prefill's KV blocks into this engine's KV cache, then decode.

Invariants:
- Everything here runs on the engine thread; the shared `BlockMigrator` (one per engine,
  `TransferHub`) connects, reads and polls on its own thread. Statuses: WAITING_MIGRATION
  -> RUNNING_MIGRATION (blocks allocated, read submitted) -> MIGRATION_LOCKED (read
  issued) -> MIGRATION_DONE (read complete) -> RUNNING (the engine emits the prefill's
  first token, then decodes).
- Remote block `mr.block_ids[i]` lands in local block `local[i]` (fresh blocks from
  `allocate_blocks`; adjacent runs are merged into one transfer). The pools' block sizes,
  dtypes and shapes must be equal: the layout was checked against the request
  (`check_migration`) and is checked against the peer's pool from the handshake.
- The read job holds its own ref (`hold`) on the destination blocks until the migrator
  reports it terminal (done/failed come only once nothing can write into them), so a
  sequence aborted mid-read never frees blocks a transfer still writes into.
- Every migration request consumed here is acked to the prefill engine exactly once: by
  the migrator after a successful read, or here (ok=False) after a failed read, an
  abandoned one, or when the first token alone finishes the request (nothing to read).
- Images: this engine has no image features, so a migrated sequence with image spans is
  admitted only with blocks for its whole length (prompt + max_tokens) and is never
  preempted (`preemptible=False`); text-only ones may be preempted and recompute.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from epd.errors import EPDError, invalid_request, service_unavailable, upstream_error
from epd.llm.migration.migrator import AckOnDone, MigrationJob
from epd.llm.pd.producer import KV_POOL
from epd.statemachine import SeqStatus, transition

logger = logging.getLogger(__name__)

STAGE = "pd_migration"
LEASE_MARGIN_S = 1.0  # stop reading this long before the prefill's lease ends
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


@dataclass
class _Pull:
    seq: Any
    started: float
    job_id: str | None = None  # set while the read is in flight
    hold: str | None = None
    done: bool = False
    error: EPDError | None = None
    ended: bool = False  # the sequence is gone; kept until the read is terminal


class PDMigrations:
    def __init__(self, config: Any, blocks: Any, kv_tensor: Any, layout: Any, hub: Any,
                 *, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.config = config
        self.blocks = blocks
        self.layout = layout
        self.hub = hub
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        hub.register_pool(KV_POOL, kv_tensor)
        self._pulls: dict[str, _Pull] = {}
        self._jobs: dict[str, str] = {}  # job id -> request id
        self._blocked_since: dict[str, float] = {}
        self.counts = {"migrations": 0, "failed": 0, "bytes": 0, "skipped": 0}
        self.latency_buckets = [0] * len(LATENCY_BUCKETS)
        self.latency_sum = 0.0

    @property
    def busy(self) -> bool:
        return bool(self._pulls) or bool(self._blocked_since)

    def is_blocked(self, request_id: str) -> bool:
        return request_id in self._blocked_since

    def first_token_finishes(self, seq: Any) -> bool:
        """The prefill's first token alone ends the request (the engine's own checks,
        stop strings aside): no KV is needed."""
        tok, sp = seq.migration.first_token, seq.sampling
        return (tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.eos_token_ids)
                or sp.max_tokens <= 1 or seq.num_tokens + 1 >= self.max_model_len)

    def skip(self, seq: Any) -> None:
        """No read for this sequence (its first token finishes it): free the prefill's blocks."""
        self.counts["skipped"] += 1
        self._ack(seq.migration, ok=False, detail="not needed: the first token finished it")

    def advance(self, waiting: list[Any], events: list[Any]) -> tuple[list, list]:
        """Apply migrator events and start reads for `waiting` (WAITING_MIGRATION, not
        finished by their first token). Returns (failed: [(seq, EPDError)], ready: [seq]):
        ready sequences are RUNNING with their prompt's KV in place."""
        for ev in events:
            self._on_event(ev)
        failed: list[tuple[Any, EPDError]] = []
        ready: list[Any] = []
        for seq in waiting:
            if seq.request_id not in self._pulls:
                err = self._begin(seq)
                if err is not None:
                    failed.append((seq, err))
                    self.counts["failed"] += 1
                    self._ack(seq.migration, ok=False, detail=err.message)
        for rid, p in list(self._pulls.items()):
            if p.job_id is not None:
                continue  # in flight
            del self._pulls[rid]
            if p.ended:
                continue
            if p.error is not None:
                failed.append((p.seq, p.error))
            elif p.done:
                transition(p.seq, SeqStatus.RUNNING)
                p.seq.num_computed_tokens = p.seq.num_prompt_tokens
                p.seq.num_cached_tokens = p.seq.migration.num_cached_tokens
                ready.append(p.seq)
        return failed, ready

    def release(self, seq: Any) -> None:
        """The sequence ended: forget it (its in-flight read keeps its own hold)."""
        if self._blocked_since.pop(seq.request_id, None) is not None:
            self._ack(seq.migration, ok=False, detail="the request ended before its read")
        p = self._pulls.get(seq.request_id)
        if p is not None:
            p.ended = True
            if p.job_id is None:
                del self._pulls[seq.request_id]

    # -- internals -------------------------------------------------------------------
    def _begin(self, seq: Any) -> EPDError | None:
        mr, rid = seq.migration, seq.request_id
        now = time.monotonic()
        first = self._blocked_since.setdefault(rid, now)
        n_remote = len(mr.block_ids)
        n_local = n_remote
        if not seq.preemptible:  # whole length now: it will never get more blocks
            total = min(seq.num_prompt_tokens + seq.sampling.max_tokens, self.max_model_len)
            n_local = max(n_remote, self.blocks.blocks_needed(total))
        local = self.blocks.allocate_blocks(rid, n_local)
        if local is None:
            if now - first > self.config.migration_timeout_s:
                del self._blocked_since[rid]
                return service_unavailable(
                    f"no free KV blocks for {self.config.migration_timeout_s:g} s", 1.0)
            return None
        del self._blocked_since[rid]
        deadline = now + self.config.migration_timeout_s
        if mr.lease_expires_at is not None:
            deadline = min(deadline, now + mr.lease_expires_at - time.time() - LEASE_MARGIN_S)
        if deadline <= now:
            self.blocks.free(rid)
            return upstream_error(f"{STAGE} failed: the prefill engine's lease on the KV "
                                  "blocks has (nearly) expired", stage=STAGE)
        job_id = uuid.uuid4().hex
        dst = local[:n_remote]
        p = _Pull(seq, now, job_id=job_id, hold=self.blocks.hold(dst))
        self._pulls[rid] = p
        self._jobs[job_id] = rid
        self.hub.migrator.submit(MigrationJob(
            job_id=job_id, peer_id=mr.engine_id, peer_url=mr.engine_url, local_pool=KV_POOL,
            remote_pool=mr.pool_name, local_block_ids=dst, remote_block_ids=list(mr.block_ids),
            block_nbytes=self.layout.block_nbytes, deadline=deadline,
            check=self._pool_check, ack=AckOnDone(mr.ack_address, (mr.lease_id,)),
        ))  # fmt: skip
        transition(seq, SeqStatus.RUNNING_MIGRATION)
        return None

    def _pool_check(self, pool: Any) -> EPDError | None:
        """The peer's KV pool (from the handshake) against ours, before any read."""
        mine = (self.layout.dtype, self.layout.block_nbytes)
        if (pool.dtype, pool.block_nbytes) != mine:
            return upstream_error(
                f"{STAGE} refused: the prefill engine's KV pool is {pool.dtype} with "
                f"{pool.block_nbytes} bytes per block; this engine's is {mine[0]} with "
                f"{mine[1]} (start both with the same model, --dtype and --block-size)",
                stage=STAGE)
        return None

    def _on_event(self, ev: Any) -> None:
        rid = self._jobs.get(ev.job_id)
        if rid is None:
            return  # not ours (an EPD feature read)
        p = self._pulls[rid]
        if ev.kind == "issued":
            if not p.ended and p.seq.status is SeqStatus.RUNNING_MIGRATION:
                transition(p.seq, SeqStatus.MIGRATION_LOCKED)
            return
        # Terminal: nothing writes into the destination blocks any more.
        del self._jobs[ev.job_id]
        p.job_id = None
        self.blocks.release(p.hold)
        if ev.kind == "done":
            p.done = True
            self.counts["migrations"] += 1
            self.counts["bytes"] += ev.nbytes
            self._observe(time.monotonic() - p.started)
            if not p.ended:
                if p.seq.status is SeqStatus.RUNNING_MIGRATION:
                    transition(p.seq, SeqStatus.MIGRATION_LOCKED)
                transition(p.seq, SeqStatus.MIGRATION_DONE)
            return
        self.counts["failed"] += 1
        p.error = self._as_error(ev.error, p.seq.migration)
        self._ack(p.seq.migration, ok=False, detail=p.error.message)
        if p.ended:
            del self._pulls[rid]

    def _observe(self, seconds: float) -> None:
        self.latency_sum += seconds
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.latency_buckets[i] += 1

    def _ack(self, mr: Any, *, ok: bool, detail: str) -> None:
        if self.hub.migrator is not None:
            self.hub.migrator.ack(mr.ack_address, [mr.lease_id], ok=ok, detail=detail[:500])

    @staticmethod
    def _as_error(exc: Exception | None, mr: Any) -> EPDError:
        if isinstance(exc, EPDError):
            return exc
        if isinstance(exc, ValueError) and "outside pool" in str(exc):
            return invalid_request(f"{STAGE}: {exc}", "migration_request.block_ids",
                                   "migration_request_mismatch")
        return upstream_error(
            f"{STAGE} failed: reading KV blocks from prefill engine {mr.engine_id!r}: "
            f"{type(exc).__name__}: {exc}", stage=STAGE)

    def stats(self) -> dict[str, Any]:
        return {
            "pd_num_migrating": len(self._pulls) + len(self._blocked_since),
            "pd_migrations": self.counts["migrations"],
            "pd_migrations_failed": self.counts["failed"],
            "pd_migration_bytes": self.counts["bytes"],
            "pd_migration_seconds_sum": round(self.latency_sum, 6),
            "pd_migration_seconds_buckets": tuple(self.latency_buckets),
        }
