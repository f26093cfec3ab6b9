"""`BlockMigrator`: pull blocks of a peer's pool into blocks of a local pool, off the
engine thread ("read these remote blocks of pool X on peer P into these local blocks of
pool Y, with a deadline, then ack").

Invariants:
- One daemon thread owns connects (handshakes), read issuing, polling and deadlines; the
  engine thread only calls `submit`, `events`, `ack` and `close`. Results come back as
  `MigrationEvent`s (`issued`, then `done` or `failed`; or `failed` alone), drained by the
  consumer; `notify()` is called after each batch of new events so a sleeping engine
  wakes up.
- A `failed` (or `done`) event is posted only once nothing can write into the job's local
  blocks any more: the transfer future finished, or the peer's endpoint was torn down
  (dlslime joins its I/O thread). The caller frees the destination only after it.
- A deadline that passes with the read still in flight disconnects that peer (failing
  its other in-flight reads too); a failed read disconnects it as well, so the next job
  reconnects with a fresh handshake. Connections are otherwise reused per peer, and a
  stale failure never tears down a newer connection (per-peer generations).
- Remote block ids are checked against the pool sizes from the peer's handshake (and by
  the job's own `check`) before anything is issued.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from epd.transfer import (
    Ack,
    PoolInfo,
    TransferEngine,
    TransferError,
    TransferFuture,
    merge_block_ops,
)

logger = logging.getLogger(__name__)

HandshakeFactory = Callable[[str, str, float], Callable[[dict], dict]]
PoolCheck = Callable[[PoolInfo], Exception | None]
_MIN_POLL_S, _MAX_POLL_S = 5e-5, 2e-3


@dataclass(frozen=True)
class AckOnDone:
    """Release ack sent (ZMQ, JSON) after the job's read succeeded."""

    address: str
    lease_ids: tuple[str, ...]


@dataclass
class MigrationJob:
    """Copy remote blocks `remote_block_ids[i]` of `remote_pool` into local blocks
    `local_block_ids[i]` of `local_pool`; a block is `block_nbytes` bytes on both sides
    (pass rows and the row size when the two pools use different block sizes)."""

    job_id: str
    peer_id: str
    peer_url: str  # HTTP base URL of the peer's transfer handshake
    local_pool: str
    remote_pool: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    block_nbytes: int
    deadline: float  # time.monotonic()
    check: PoolCheck | None = None  # validate against the peer's pool before reading
    ack: AckOnDone | None = None


@dataclass(frozen=True)
class MigrationEvent:
    job_id: str
    kind: Literal["issued", "done", "failed"]
    error: Exception | None = None
    nbytes: int = 0


@dataclass
class _InFlight:
    job: MigrationJob
    future: TransferFuture
    generation: int


@dataclass
class _Peer:
    generation: int
    pools: dict[str, PoolInfo] = field(default_factory=dict)


def _http_handshake(url: str, my_id: str, timeout_s: float) -> Callable[[dict], dict]:
    from epd.transfer import http_handshake

    return http_handshake(url, my_id, timeout_s=timeout_s)


class BlockMigrator:
    def __init__(
        self,
        transfer: TransferEngine,
        *,
        notify: Callable[[], None] = lambda: None,
        handshake: HandshakeFactory = _http_handshake,
        handshake_timeout_s: float = 10.0,
    ) -> None:
        from epd.transfer import AckSender

        self.transfer = transfer
        self._notify = notify
        self._handshake = handshake
        self._handshake_timeout_s = handshake_timeout_s
        self._acks = AckSender()
        self._cond = threading.Condition()
        self._inbox: list[MigrationJob] = []
        self._events: list[MigrationEvent] = []
        self._inflight: dict[str, _InFlight] = {}
        self._peers: dict[str, _Peer] = {}
        self._generations = 0
        self._stopping = False
        self.num_done = 0
        self.num_failed = 0
        self._thread = threading.Thread(target=self._run, name="epd-migrator", daemon=True)
        self._thread.start()

    # -- engine side -----------------------------------------------------------------
    def submit(self, job: MigrationJob) -> None:
        with self._cond:
            if self._stopping:
                raise RuntimeError("the migrator is closed")
            self._inbox.append(job)
            self._cond.notify()

    def events(self) -> list[MigrationEvent]:
        with self._cond:
            out, self._events = self._events, []
        return out

    def has_events(self) -> bool:
        with self._cond:
            return bool(self._events)

    @property
    def num_in_flight(self) -> int:
        with self._cond:
            return len(self._inbox) + len(self._inflight)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def ack(self, address: str, lease_ids: list[str], *, ok: bool = True, detail: str = "") -> None:
        """Send a release ack (never blocks; a lost ack is covered by lease expiry)."""
        msg = Ack(kind="release", lease_ids=list(lease_ids), consumer_id=self.transfer.engine_id,
                  ok=ok, detail=detail)
        try:
            self._acks.send(address, msg)
        except Exception:
            logger.exception("sending an ack to %s failed; the lease will expire", address)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread; in-flight reads end when the transfer engine is closed."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout_s)
        self._acks.close()

    # -- migrator thread -------------------------------------------------------------
    def _run(self) -> None:
        sleep_s = _MIN_POLL_S
        while True:
            with self._cond:
                if not (self._stopping or self._inbox):
                    self._cond.wait(sleep_s if self._inflight else None)
                if self._stopping:
                    return
                new, self._inbox = self._inbox, []
            events: list[MigrationEvent] = []
            try:
                for job in new:
                    self._start(job, events)
                progressed = self._poll(events)
            except Exception:  # never die silently: the engine would wait forever
                logger.exception("migrator iteration failed")
                progressed = True
            sleep_s = _MIN_POLL_S if (new or progressed) else min(sleep_s * 2, _MAX_POLL_S)
            if events:
                with self._cond:
                    self._events.extend(events)
                self._notify()

    def _start(self, job: MigrationJob, events: list[MigrationEvent]) -> None:
        try:
            generation, pools = self._connect(job)
            remote = pools.get(job.remote_pool)
            if remote is None:
                raise TransferError(f"peer {job.peer_id!r} has no pool {job.remote_pool!r}")
            if job.check is not None and (err := job.check(remote)) is not None:
                events.append(MigrationEvent(job.job_id, "failed", err))
                return
            self._check_range(job, remote)
            ops = merge_block_ops(job.local_block_ids, job.remote_block_ids, job.block_nbytes)
            future = self.transfer.read(job.peer_id, job.local_pool, job.remote_pool, ops)
        except Exception as exc:
            if isinstance(exc, TransferError):
                self._disconnect(job.peer_id, None)
            events.append(MigrationEvent(job.job_id, "failed", exc))
            return
        self._inflight[job.job_id] = _InFlight(job, future, generation)
        events.append(MigrationEvent(job.job_id, "issued"))

    def _connect(self, job: MigrationJob) -> tuple[int, dict[str, PoolInfo]]:
        peer = self._peers.get(job.peer_id)
        if peer is not None and self.transfer.is_connected(job.peer_id):
            return peer.generation, peer.pools
        remaining = job.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"deadline passed before connecting to {job.peer_id!r}")
        inner = self._handshake(job.peer_url, self.transfer.engine_id,
                                min(self._handshake_timeout_s, remaining))
        seen: dict[str, PoolInfo] = {}

        def handshake(info: dict) -> dict:
            resp = inner(info)
            seen.update({n: PoolInfo.model_validate(p) for n, p in resp["pools"].items()})
            return resp

        self.transfer.disconnect(job.peer_id)  # a stale connection would skip the handshake
        self.transfer.connect(job.peer_id, handshake)
        self._generations += 1
        self._peers[job.peer_id] = _Peer(self._generations, seen)
        return self._generations, seen

    @staticmethod
    def _check_range(job: MigrationJob, remote: PoolInfo) -> None:
        limit = remote.nbytes // job.block_nbytes
        bad = [b for b in job.remote_block_ids if not 0 <= b < limit]
        if bad:
            raise ValueError(
                f"remote block {bad[0]} is outside pool {job.remote_pool!r} of peer "
                f"{job.peer_id!r} ({limit} blocks of {job.block_nbytes} bytes)"
            )

    def _poll(self, events: list[MigrationEvent]) -> bool:
        progressed = False
        now = time.monotonic()
        for job_id, fl in list(self._inflight.items()):
            if not fl.future.poll():
                if now < fl.job.deadline:
                    continue
                # dlslime ignores timeouts: tear the endpoint down, which ends the read.
                self._disconnect(fl.job.peer_id, fl.generation)
                if not fl.future.poll():
                    continue  # a newer connection; retried on the next round
                error: Exception | None = TimeoutError(
                    f"reading {fl.future.nbytes} bytes from {fl.job.peer_id!r} passed its deadline"
                )
            elif fl.future.error is not None:
                self._disconnect(fl.job.peer_id, fl.generation)
                error = TransferError(f"read from {fl.job.peer_id!r} failed: {fl.future.error}")
            else:
                error = None
            del self._inflight[job_id]
            progressed = True
            if error is None:
                self.num_done += 1
                if fl.job.ack is not None:
                    self.ack(fl.job.ack.address, list(fl.job.ack.lease_ids))
                events.append(MigrationEvent(job_id, "done", nbytes=fl.future.nbytes))
            else:
                self.num_failed += 1
                events.append(MigrationEvent(job_id, "failed", error))
        return progressed

    def _disconnect(self, peer_id: str, generation: int | None) -> None:
        peer = self._peers.get(peer_id)
        if generation is not None and (peer is None or peer.generation != generation):
            return  # that connection is already gone; keep the newer one
        self._peers.pop(peer_id, None)
        try:
            self.transfer.disconnect(peer_id)
        except Exception:
            logger.exception("disconnecting %s failed", peer_id)
