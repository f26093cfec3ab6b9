"""E -> P migration on the LLM side: pull a request's image features from encoders'
multimodal caches into this engine's feature pool, then let the request prefill.

Invariants:
- Everything here runs on the engine thread (`advance` at the start of every step,
  `release` when a sequence ends); the `BlockMigrator` thread only connects, reads and
  polls. So every status change (WAITING_EPD_MIGRATION -> RUNNING_EPD_MIGRATION ->
  EPD_MIGRATION_LOCKED -> WAITING) and every MMCache call happens on one thread.
- The LLM-side pool is one `MMCache` registered once with the engine's shared transfer
  engine (`TransferHub`; both created lazily, on the first EPD request). Features are keyed by `mm_hash`: an image
  already resident needs no read; one being read for another request is waited for.
- Refs: a sequence holds one ref per image until it ends (its features stay valid across
  preemption). A read job holds one more ref on each entry it fills, dropped only after
  the migrator reports the job terminal: a pending entry is never freed while a transfer
  may write into it, even when its sequence was aborted meanwhile.
- Acks: a sequence's leases are acked (ZMQ) once all of its images are resident. On a
  failure nothing is acked: the proxy releases the leases or they expire.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from epd.errors import EPDError, invalid_request, service_unavailable, upstream_error
from epd.llm.migration.hub import TransferHub
from epd.llm.migration.migrator import MigrationJob
from epd.llm.migration.rows import allocate_all, entry_rows, row_ids
from epd.llm.migration.validate import EPDImage, pool_check
from epd.statemachine import SeqStatus, transition

logger = logging.getLogger(__name__)

POOL_NAME = "mm_features"
STAGE = "epd_migration"


@dataclass
class _State:
    seq: Any  # epd.llm.sequence.Sequence
    entries: list[Any]  # MMEntry per image (the sequence's refs)
    deadline: float
    jobs: set[str] = field(default_factory=set)
    issued: set[str] = field(default_factory=set)
    waits: set[int] = field(default_factory=set)  # images another job is filling
    error: EPDError | None = None
    ok: bool = True  # every job of this sequence succeeded so far
    ended: bool = False  # the sequence is gone; kept until its jobs are terminal


@dataclass
class _Job:
    request_id: str
    created: list[Any]  # pending entries this job fills; it holds one ref on each
    peer: str


class EPDMigrations:
    def __init__(self, config: Any, *, hidden_size: int, dtype: torch.dtype,
                 notify: Any = lambda: None, hub: TransferHub | None = None) -> None:
        self.config = config
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.dtype_name = str(dtype).removeprefix("torch.")
        self.hub = hub if hub is not None else TransferHub(config, notify=notify)
        self.cache: Any = None
        self._states: dict[str, _State] = {}
        self._jobs: dict[str, _Job] = {}
        self._blocked_since: dict[str, float] = {}
        self.counts = {"migrations": 0, "failed": 0, "reads": 0, "resident_hits": 0}

    # -- setup -----------------------------------------------------------------------
    @property
    def row_nbytes(self) -> int:
        return self.hidden_size * torch.empty((), dtype=self.dtype).element_size()

    @property
    def num_blocks(self) -> int:
        c = self.config
        if c.mm_num_blocks is not None:
            return c.mm_num_blocks
        return max(1, c.mm_cache_memory_bytes // (c.mm_block_tokens * self.row_nbytes))

    # The shared transfer engine and migrator (see TransferHub).
    @property
    def handshake(self) -> Any:
        return self.hub.handshake

    @handshake.setter
    def handshake(self, factory: Any) -> None:
        self.hub.handshake = factory

    @property
    def migrator(self) -> Any:
        return self.hub.migrator

    @property
    def transfer(self) -> Any:
        return self.hub.transfer

    def start(self) -> None:
        """Create the feature pool and register it with the hub's transfer engine
        (starting the hub first; idempotent)."""
        if self.cache is not None:
            return
        from epd.mmcache import MMCache

        c = self.config
        cache = MMCache(self.num_blocks, c.mm_block_tokens, self.hidden_size, self.dtype,
                        device="cpu")
        self.hub.register_pool(POOL_NAME, cache.tensor)
        self.cache = cache
        logger.info("EPD migration: %s transfer %s, feature pool %d blocks x %d tokens",
                    self.transfer.name, self.transfer.engine_id, cache.num_blocks,
                    cache.block_tokens)

    def close(self) -> None:
        self.hub.close()  # tears endpoints down: no read is in flight after this

    # -- the engine thread -----------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self._states) or bool(self._blocked_since)

    def is_blocked(self, request_id: str) -> bool:
        """Waiting for space in the feature pool (retried on later steps)."""
        return request_id in self._blocked_since

    def has_events(self) -> bool:
        return self.hub.has_events()

    def advance(self, waiting: list[Any], events: list[Any] | None = None
                ) -> list[tuple[Any, EPDError]]:
        """Apply migration events (`events`: the hub's, drained by the caller; None:
        drain them here), start migrations for `waiting` (WAITING_EPD_MIGRATION
        sequences) and move finished ones to WAITING. Returns the sequences that failed."""
        failed: list[tuple[Any, EPDError]] = []
        for ev in self.hub.events() if events is None else events:
            self._on_event(ev)
        for seq in waiting:
            if seq.request_id not in self._states:
                err = self._begin(seq)
                if err is not None:
                    failed.append((seq, err))
                    self.counts["failed"] += 1
        for rid, st in list(self._states.items()):
            if st.ended:
                if not st.jobs:
                    self._finish_orphan(rid, st)
                continue
            self._check_waits(st)
            if st.error is not None:
                failed.append((st.seq, st.error))
                self.counts["failed"] += 1
                st.ended = True  # the engine finishes it now; release() follows
            elif not st.jobs and not st.waits:
                self._complete(rid, st)
        return failed

    def release(self, seq: Any) -> None:
        """The sequence ended (finished, aborted, failed): drop its feature refs."""
        self._blocked_since.pop(seq.request_id, None)
        if self.cache is None:
            return
        st = self._states.get(seq.request_id)
        refs = st.entries if st is not None else getattr(seq, "epd_entries", [])
        for entry in refs:
            self.cache.release(entry)
        if st is not None:
            st.entries = []
            st.ended = True
            if not st.jobs:
                del self._states[seq.request_id]
        seq.epd_entries = []

    # -- internals -------------------------------------------------------------------
    def _begin(self, seq: Any) -> EPDError | None:
        try:
            self.start()
        except Exception as exc:
            logger.exception("cannot set up EPD migration")
            return upstream_error(f"{STAGE} unavailable on this engine: {exc}", stage=STAGE)
        images: list[EPDImage] = list(seq.epd.images)
        now = time.monotonic()
        first = self._blocked_since.setdefault(seq.request_id, now)
        try:
            got = allocate_all(self.cache, [(i.ref.mm_hash, i.ref.num_tokens) for i in images])
        except ValueError as exc:  # same mm_hash resident with another token count
            self._blocked_since.pop(seq.request_id, None)
            return invalid_request(str(exc), images[0].param, "encoder_result_mismatch")
        if got is None:
            if now - first > self.config.migration_timeout_s:
                self._blocked_since.pop(seq.request_id, None)
                return service_unavailable(
                    f"no space in the feature pool for {self.config.migration_timeout_s:g} s")
            return None
        del self._blocked_since[seq.request_id]
        entries, created = got
        st = _State(seq, entries, now + self.config.migration_timeout_s)
        self._states[seq.request_id] = st
        by_encoder: dict[int, list[int]] = defaultdict(list)
        for k, (img, entry) in enumerate(zip(images, entries, strict=True)):
            if k in created:
                by_encoder[id(img.result)].append(k)
            elif not entry.ready:
                st.waits.add(k)
            else:
                self.counts["resident_hits"] += 1
        for ks in by_encoder.values():
            self._submit(st, [images[k] for k in ks], [entries[k] for k in ks])
        transition(seq, SeqStatus.RUNNING_EPD_MIGRATION)
        return None

    def _submit(self, st: _State, images: list[EPDImage], entries: list[Any]) -> None:
        result = images[0].result
        local: list[int] = []
        remote: list[int] = []
        for img, entry in zip(images, entries, strict=True):
            # rows, not blocks: the two pools' block sizes may differ
            local += row_ids(entry.block_ids, self.cache.block_tokens, entry.num_tokens)
            remote += row_ids(img.ref.block_ids, img.ref.block_tokens, img.ref.num_tokens)
            self.cache.acquire(entry)  # the job's ref
        job_id = uuid.uuid4().hex
        self._jobs[job_id] = _Job(st.seq.request_id, list(entries), result.encoder_id)
        st.jobs.add(job_id)
        self.counts["reads"] += 1
        assert self.migrator is not None
        self.migrator.submit(MigrationJob(
            job_id=job_id, peer_id=result.encoder_id, peer_url=result.encoder_url,
            local_pool=POOL_NAME, remote_pool=result.pool_name, local_block_ids=local,
            remote_block_ids=remote, block_nbytes=self.row_nbytes, deadline=st.deadline,
            check=pool_check(images, self.dtype_name),
        ))  # fmt: skip

    def _on_event(self, ev: Any) -> None:
        job = self._jobs.get(ev.job_id)
        if job is None:
            return
        st = self._states.get(job.request_id)
        if ev.kind == "issued":
            if st is not None:
                st.issued.add(ev.job_id)
                self._lock_if_issued(st)
            return
        del self._jobs[ev.job_id]
        # Terminal: nothing writes into the job's entries any more.
        for entry in job.created:
            if ev.kind == "done" and not entry.freed:
                self.cache.commit(entry, entry_rows(self.cache, entry).clone())
            elif ev.kind == "failed":
                self.cache.drop(entry)
            self.cache.release(entry)
        if st is None:
            return
        st.jobs.discard(ev.job_id)
        if ev.kind == "failed":
            st.ok = False
            if st.error is None:
                st.error = self._as_error(ev.error, job.peer)

    def _lock_if_issued(self, st: _State) -> None:
        if st.seq.status is SeqStatus.RUNNING_EPD_MIGRATION and st.jobs <= st.issued:
            transition(st.seq, SeqStatus.EPD_MIGRATION_LOCKED)

    def _check_waits(self, st: _State) -> None:
        for k in list(st.waits):
            entry = st.entries[k]
            if entry.freed and st.error is None:
                st.error = upstream_error(
                    f"{STAGE} failed: another request's read of the same image failed",
                    stage=STAGE)
            elif entry.ready:
                st.waits.discard(k)

    def _complete(self, rid: str, st: _State) -> None:
        seq = st.seq
        for item, entry in zip(seq.mm_items, st.entries, strict=True):
            item.features = entry_rows(self.cache, entry)
        seq.epd_entries, st.entries = st.entries, []
        if seq.status is SeqStatus.RUNNING_EPD_MIGRATION:
            transition(seq, SeqStatus.EPD_MIGRATION_LOCKED)
        transition(seq, SeqStatus.WAITING)
        del self._states[rid]
        self.counts["migrations"] += 1
        self._ack(seq.epd.images)

    def _finish_orphan(self, rid: str, st: _State) -> None:
        del self._states[rid]
        if st.ok and st.error is None:
            self._ack(st.seq.epd.images)  # read fine, nobody needs the encoder's copy

    def _ack(self, images: Any) -> None:
        assert self.migrator is not None
        by_address: dict[str, list[str]] = defaultdict(list)
        for img in images:
            by_address[img.result.ack_address].append(img.ref.lease_id)
        for address, lease_ids in by_address.items():
            self.migrator.ack(address, lease_ids)

    def _as_error(self, exc: Exception | None, peer: str) -> EPDError:
        if isinstance(exc, EPDError):
            return exc
        return upstream_error(
            f"{STAGE} failed: reading image features from encoder {peer!r}: "
            f"{type(exc).__name__}: {exc}", stage=STAGE)

    def stats(self) -> dict[str, int]:
        cache = self.cache
        return {
            "mm_blocks_total": self.num_blocks,
            "mm_blocks_free": self.num_blocks if cache is None
            else cache.num_free_blocks + cache.num_evictable_blocks,
            "mm_blocks_referenced": 0 if cache is None else cache.num_referenced_blocks,
            "num_migrating": sum(not st.ended for st in self._states.values())
            + len(self._blocked_since),
            "epd_migrations": self.counts["migrations"],
            "epd_migrations_failed": self.counts["failed"],
        }
