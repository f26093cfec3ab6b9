"""Leases on things handed to another process (mm cache entries, KV blocks).

A lease ends exactly once: by ``release`` (the peer's ack) or by ``expire`` (the ack never
came). Both remove the lease and hand its payload back to the owner, who decides what
releasing it means; a second release of the same id returns None. Thread-safe: every
method takes the table's lock, and `snapshot()` is the only way to see all live leases
(a copy, so callers never iterate the table while another thread changes it).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Lease(Generic[T]):
    lease_id: str
    payload: T
    holder: str
    expires_at: float  # unix time, for peers and logs
    deadline: float  # on the table's monotonic clock, for expiry


class LeaseTable(Generic[T]):
    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock
        self._wall_clock = wall_clock
        self._leases: dict[str, Lease[T]] = {}
        self._lock = threading.Lock()

    def grant(self, payload: T, ttl_s: float, holder: str = "") -> Lease[T]:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        lease = Lease(
            lease_id=uuid.uuid4().hex,
            payload=payload,
            holder=holder,
            expires_at=self._wall_clock() + ttl_s,
            deadline=self._clock() + ttl_s,
        )
        with self._lock:
            self._leases[lease.lease_id] = lease
        return lease

    def release(self, lease_id: str) -> T | None:
        """The payload of a live lease (which ends now); None if unknown or already ended."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
        return None if lease is None else lease.payload

    def expire(self, now: float | None = None) -> list[Lease[T]]:
        """Remove and return the leases whose deadline is at or before ``now`` (default:
        the clock), earliest deadline first."""
        with self._lock:
            now = self._clock() if now is None else now
            expired = sorted(
                (lease for lease in self._leases.values() if lease.deadline <= now),
                key=lambda lease: lease.deadline,
            )
            for lease in expired:
                del self._leases[lease.lease_id]
        return expired

    def get(self, lease_id: str) -> Lease[T] | None:
        with self._lock:
            return self._leases.get(lease_id)

    def snapshot(self) -> list[Lease[T]]:
        """The live leases at this instant, earliest deadline first (a copy: leases are
        frozen, and ending one later does not change the returned list)."""
        with self._lock:
            return sorted(self._leases.values(), key=lambda lease: lease.deadline)

    def next_deadline(self) -> float | None:
        with self._lock:
            return min((lease.deadline for lease in self._leases.values()), default=None)

    def __contains__(self, lease_id: object) -> bool:
        with self._lock:
            return lease_id in self._leases

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)
