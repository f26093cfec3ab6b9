"""Transfer interface: read ops, futures and the `TransferEngine` contract.

Invariants:

- A pool is one contiguous tensor registered once under a name; block ids, never
  tensors or pointers, cross process boundaries. A `ReadOp` is a byte range
  (`local_offset`, `remote_offset`, `length`) relative to the start of the pools.
- `TransferEngine.read` validates every op against both pools' sizes *before*
  issuing anything: dlslime does not check ranges (its TCP server copies whatever
  address it is asked for), so an unchecked op would read or write outside a pool.
- A `TransferFuture` keeps references to the pools (tensors) it reads into and from,
  so nothing is freed while a transfer may be in flight. dlslime ignores its own
  `timeout_ms`: deadlines are the caller's job. `wait(timeout_s)` returning False
  means "not done yet"; the destination must not be freed or reused until `poll()`
  returns True (the read finished, failed, or its endpoint was torn down, which
  stops the I/O thread that writes into it).
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


class TransferError(RuntimeError):
    """A connection, handshake or backend failure (not a caller's bad argument)."""


@dataclass(frozen=True)
class ReadOp:
    """Copy `length` bytes from remote pool byte `remote_offset` to local byte `local_offset`."""

    local_offset: int
    remote_offset: int
    length: int

    def __post_init__(self) -> None:
        for name in ("local_offset", "remote_offset", "length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"ReadOp.{name} must be an int, got {type(value).__name__}")
            if value < 0:
                raise ValueError(f"ReadOp.{name} must be >= 0, got {value}")
        if self.length == 0:
            raise ValueError("ReadOp.length must be > 0")


def merge_block_ops(
    local_block_ids: Sequence[int],
    remote_block_ids: Sequence[int],
    block_nbytes: int,
    *,
    local_base: int = 0,
    remote_base: int = 0,
) -> list[ReadOp]:
    """Ops reading remote block `remote_block_ids[i]` into local block `local_block_ids[i]`.

    Runs where both sides are consecutive (`+1` on both) become one op, in order.
    """
    if len(local_block_ids) != len(remote_block_ids):
        raise ValueError(
            f"block id lists differ in length: {len(local_block_ids)} local vs "
            f"{len(remote_block_ids)} remote"
        )
    if block_nbytes <= 0:
        raise ValueError(f"block_nbytes must be > 0, got {block_nbytes}")
    ops: list[ReadOp] = []
    run_local = run_remote = run_len = 0
    prev: tuple[int, int] | None = None
    for local_id, remote_id in zip(local_block_ids, remote_block_ids, strict=True):
        local_id, remote_id = int(local_id), int(remote_id)
        if local_id < 0 or remote_id < 0:
            raise ValueError(f"negative block id in ({local_id}, {remote_id})")
        if prev is not None and local_id == prev[0] + 1 and remote_id == prev[1] + 1:
            run_len += 1
        else:
            if prev is not None:
                ops.append(
                    _block_op(run_local, run_remote, run_len, block_nbytes, local_base, remote_base)
                )
            run_local, run_remote, run_len = local_id, remote_id, 1
        prev = (local_id, remote_id)
    if prev is not None:
        ops.append(_block_op(run_local, run_remote, run_len, block_nbytes, local_base, remote_base))
    return ops


def _block_op(
    local: int, remote: int, n: int, nbytes: int, local_base: int, remote_base: int
) -> ReadOp:
    return ReadOp(local_base + local * nbytes, remote_base + remote * nbytes, n * nbytes)


def validate_ops(ops: Sequence[ReadOp], local_nbytes: int, remote_nbytes: int) -> int:
    """Raise ValueError unless every op lies inside both pools; return the total bytes."""
    if not ops:
        raise ValueError("no read ops")
    total = 0
    for i, op in enumerate(ops):
        if not isinstance(op, ReadOp):
            raise TypeError(f"ops[{i}] is {type(op).__name__}, not ReadOp")
        if op.local_offset + op.length > local_nbytes:
            raise ValueError(
                f"ops[{i}] local range [{op.local_offset}, {op.local_offset + op.length}) "
                f"exceeds the local pool ({local_nbytes} bytes)"
            )
        if op.remote_offset + op.length > remote_nbytes:
            raise ValueError(
                f"ops[{i}] remote range [{op.remote_offset}, {op.remote_offset + op.length}) "
                f"exceeds the remote pool ({remote_nbytes} bytes)"
            )
        total += op.length
    return total


class TransferFuture:
    """Completion of one `read`, made of one or more backend calls ("parts").

    `check(part)` returns None while the part is in flight, else its status (0 = ok).
    """

    def __init__(
        self,
        parts: list[Any],
        check: Callable[[Any], int | None],
        *,
        keepalive: tuple[Any, ...] = (),
        nbytes: int = 0,
        error: str | None = None,
    ) -> None:
        self._pending = list(parts)
        self._check = check
        self._keepalive: tuple[Any, ...] | None = keepalive
        self._lock = threading.Lock()
        self._aborted: str | None = None
        self.nbytes = nbytes
        self.error: str | None = error

    def poll(self) -> bool:
        """True once every part finished (or the endpoint was torn down); never blocks."""
        with self._lock:
            if self._aborted is not None and self._pending:
                self._pending.clear()
                self.error = self.error or self._aborted
            still: list[Any] = []
            for part in self._pending:
                status = self._check(part)
                if status is None:
                    still.append(part)
                elif status != 0 and self.error is None:
                    self.error = f"transfer failed with dlslime status {status}"
            self._pending = still
            if not still:
                self._keepalive = None  # safe to release the buffers now
            return not still

    def wait(self, timeout_s: float | None = None) -> bool:
        """Poll until done or `timeout_s` elapsed (None: no limit); return poll()."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        sleep_s = 0.0
        while not self.poll():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            # Back off: dlslime's own wait() busy-spins a core, which starves 2-core hosts.
            time.sleep(sleep_s)
            sleep_s = min(max(sleep_s * 2, 2e-5), 1e-3)
        return True

    @property
    def ok(self) -> bool:
        return self.poll() and self.error is None

    def _abort(self, reason: str) -> None:
        """Called by the engine after the endpoint's I/O stopped: nothing is in flight."""
        with self._lock:
            self._aborted = reason


HandshakeFn = Callable[[dict], dict]


class TransferEngine(ABC):
    """One process's side of the data plane: registered pools plus per-peer connections.

    Producer (owns the blocks): `register_pool`, then answers handshakes with `accept`.
    Consumer (pulls blocks): `register_pool`, `connect(peer_id, handshake)`, `read`.
    """

    name: str = "abstract"

    @property
    @abstractmethod
    def engine_id(self) -> str: ...

    @abstractmethod
    def register_pool(self, name: str, tensor: Any) -> None: ...

    @abstractmethod
    def local_info(self) -> dict: ...

    @abstractmethod
    def accept(self, peer_id: str, peer_info: dict) -> dict: ...

    @abstractmethod
    def connect(self, peer_id: str, handshake: HandshakeFn) -> None: ...

    @abstractmethod
    def is_connected(self, peer_id: str) -> bool: ...

    @abstractmethod
    def disconnect(self, peer_id: str) -> None: ...

    @abstractmethod
    def read(
        self, peer_id: str, local_pool: str, remote_pool: str, ops: list[ReadOp]
    ) -> TransferFuture: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
