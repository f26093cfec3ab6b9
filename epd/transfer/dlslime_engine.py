"""The dlslime-based `TransferEngine` shared by the TCP and RDMA backends.

Connection model (one dlslime endpoint per (this process, peer) pair, both directions):

- consumer `connect(peer_id, handshake)`: creates an endpoint, registers every local
  pool on it, sends `{"backend", "engine_id", "endpoint": endpoint_info()}` through
  `handshake`, connects to the producer endpoint from the answer and registers the
  remote pools' memory regions. Reused per peer until `disconnect(peer_id)`.
- producer `accept(peer_id, info)`: creates (or reuses, while the consumer's endpoint
  info is unchanged) an endpoint for that consumer, registers every local pool,
  connects back (RDMA needs both sides connected; on TCP it only checks reachability)
  and returns a `HandshakeResponse` dict.

Reads are split into dlslime calls of at most 31 assignments: dlslime tracks completion
in a 32-bit mask, and on TCP the 33rd assignment would set bit 0 again, so a read could
report completion while data is still arriving.

`disconnect`/`close` shut the endpoint down first (dlslime joins its I/O thread, so no
byte lands in a buffer afterwards) and only then mark that peer's pending futures done
with an error.
"""

from __future__ import annotations

import logging
import threading
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from epd.transfer.base import (
    HandshakeFn,
    ReadOp,
    TransferEngine,
    TransferError,
    TransferFuture,
    validate_ops,
)
from epd.transfer.messages import HandshakeResponse, PoolInfo

logger = logging.getLogger(__name__)

MAX_ASSIGNMENTS_PER_CALL = 31


@dataclass
class _Pool:
    tensor: torch.Tensor
    info: PoolInfo


@dataclass
class _Conn:
    endpoint: Any
    local_handles: dict[str, int]
    peer_endpoint: dict = field(default_factory=dict)
    remote_handles: dict[str, int] = field(default_factory=dict)
    remote_pools: dict[str, PoolInfo] = field(default_factory=dict)
    remote_engine_id: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False
    futures: weakref.WeakSet = field(default_factory=weakref.WeakSet)


class DlslimeTransferEngine(TransferEngine):
    name = "dlslime"

    def __init__(self, host: str = "127.0.0.1", *, engine_id: str | None = None) -> None:
        self.host = host
        self._engine_id = engine_id or f"{self.name}-{uuid.uuid4().hex[:12]}"
        self._pools: dict[str, _Pool] = {}
        self._peers: dict[str, _Conn] = {}  # consumer side: producers we read from
        self._accepted: dict[str, _Conn] = {}  # producer side: consumers reading from us
        self._lock = threading.Lock()  # guards the dicts above
        self._connect_lock = threading.Lock()  # serialises endpoint setup / teardown
        self._closed = False

    # -- backend hooks ---------------------------------------------------------------
    def _new_endpoint(self) -> Any:
        raise NotImplementedError

    def _check_tensor(self, tensor: torch.Tensor) -> None:
        """Raise ValueError for tensors this backend cannot serve."""

    def _endpoint_connected(self, endpoint: Any) -> bool:
        return True

    def _start_read(self, endpoint: Any, assign: list[tuple[int, int, int, int, int]]) -> Any:
        return endpoint.read(assign)

    def _check_part(self, part: Any) -> int | None:
        raise NotImplementedError

    # -- pools -----------------------------------------------------------------------
    @property
    def engine_id(self) -> str:
        return self._engine_id

    def register_pool(self, name: str, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"pool {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
        if not name:
            raise ValueError("pool name must be non-empty")
        if not tensor.is_contiguous():
            raise ValueError(f"pool {name!r} must be contiguous (one memory region per pool)")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            raise ValueError(f"pool {name!r} is empty")
        self._check_tensor(tensor)
        num_blocks = tensor.shape[0] if tensor.dim() >= 1 else 1
        info = PoolInfo(
            nbytes=nbytes,
            block_nbytes=nbytes // num_blocks if num_blocks else 0,
            num_blocks=num_blocks,
            dtype=str(tensor.dtype).removeprefix("torch."),
        )
        with self._connect_lock, self._lock:
            self._ensure_open()
            if name in self._pools:
                raise ValueError(f"pool {name!r} is already registered")
            self._pools[name] = _Pool(tensor, info)
            # Existing connections learn about it locally; peers see it on their next handshake.
            for conn in [*self._peers.values(), *self._accepted.values()]:
                conn.local_handles[name] = self._register(conn.endpoint, name, tensor, nbytes)

    def pool_info(self, name: str) -> PoolInfo:
        return self._pools[name].info

    def local_info(self) -> dict:
        with self._lock:
            pools = {n: p.info.model_dump() for n, p in self._pools.items()}
        return {
            "engine_id": self.engine_id,
            "backend": self.name,
            "host": self.host,
            "pools": pools,
        }

    # -- handshake -------------------------------------------------------------------
    def accept(self, peer_id: str, peer_info: dict) -> dict:
        backend = peer_info.get("backend")
        if backend != self.name:
            raise TransferError(
                f"peer {peer_id!r} uses backend {backend!r}, this engine {self.name!r}"
            )
        remote_ep = peer_info.get("endpoint")
        if not isinstance(remote_ep, dict):
            raise TransferError(f"peer {peer_id!r} sent no endpoint info")
        with self._connect_lock:
            self._ensure_open()
            conn = self._accepted.get(peer_id)
            if conn is not None and conn.peer_endpoint != remote_ep:
                logger.info(
                    "peer %s reconnected with a new endpoint; replacing the old one", peer_id
                )
                self._teardown(self._accepted, peer_id, "peer reconnected")
                conn = None
            if conn is None:
                conn = self._open_conn()
                conn.peer_endpoint = remote_ep
                try:
                    conn.endpoint.connect(remote_ep)
                except Exception:
                    conn.endpoint.shutdown()
                    raise
                with self._lock:
                    self._accepted[peer_id] = conn
            with self._lock:
                pools = {n: p.info for n, p in self._pools.items()}
            info = {"endpoint": conn.endpoint.endpoint_info()}
        resp = HandshakeResponse(peer_id=self.engine_id, backend=self.name, info=info, pools=pools)
        return resp.model_dump(mode="json")

    def connect(self, peer_id: str, handshake: HandshakeFn) -> None:
        with self._connect_lock:
            self._ensure_open()
            if self.is_connected(peer_id):
                return
            self._teardown(self._peers, peer_id, "reconnecting")
            conn = self._open_conn()
            try:
                request = {
                    "backend": self.name,
                    "engine_id": self.engine_id,
                    "endpoint": conn.endpoint.endpoint_info(),
                }
                self._finish_connect(
                    peer_id, conn, HandshakeResponse.model_validate(handshake(request))
                )
            except BaseException:
                conn.endpoint.shutdown()
                raise
            with self._lock:
                self._peers[peer_id] = conn
        logger.info("%s connected to peer %s (%s)", self.name, peer_id, conn.remote_engine_id)

    def _finish_connect(self, peer_id: str, conn: _Conn, resp: HandshakeResponse) -> None:
        if resp.backend != self.name:
            raise TransferError(
                f"peer {peer_id!r} answered with backend {resp.backend!r}, not {self.name!r}"
            )
        remote_ep = resp.info.get("endpoint")
        if not isinstance(remote_ep, dict):
            raise TransferError(f"peer {peer_id!r} answered without endpoint info")
        conn.endpoint.connect(remote_ep)
        if not self._endpoint_connected(conn.endpoint):
            raise TransferError(
                f"cannot reach peer {peer_id!r} data plane at {remote_ep.get('host')}:{remote_ep.get('port')}"
            )
        mr_info = remote_ep.get("mr_info") or {}
        for name, pool in resp.pools.items():
            mr = mr_info.get(name)
            if not isinstance(mr, dict) or int(mr.get("length", -1)) != pool.nbytes:
                raise TransferError(
                    f"peer {peer_id!r} pool {name!r}: memory region missing or size mismatch"
                )
            handle = conn.endpoint.register_remote_memory_region(name, mr)
            if handle < 0:
                raise TransferError(f"registering remote pool {name!r} of peer {peer_id!r} failed")
            conn.remote_handles[name] = handle
        conn.remote_pools = dict(resp.pools)
        conn.peer_endpoint = remote_ep
        conn.remote_engine_id = resp.peer_id

    def is_connected(self, peer_id: str) -> bool:
        with self._lock:
            conn = self._peers.get(peer_id)
        return conn is not None and not conn.closed and self._endpoint_connected(conn.endpoint)

    def remote_pool_info(self, peer_id: str, pool: str) -> PoolInfo:
        with self._lock:
            return self._peers[peer_id].remote_pools[pool]

    def disconnect(self, peer_id: str) -> None:
        """Drop both directions for `peer_id`; its pending reads end with an error."""
        with self._connect_lock:
            self._teardown(self._peers, peer_id, f"disconnected from {peer_id}")
            self._teardown(self._accepted, peer_id, f"disconnected from {peer_id}")

    # -- data ------------------------------------------------------------------------
    def read(
        self, peer_id: str, local_pool: str, remote_pool: str, ops: list[ReadOp]
    ) -> TransferFuture:
        with self._lock:
            conn = self._peers.get(peer_id)
            pool = self._pools.get(local_pool)
        if conn is None:
            raise TransferError(f"not connected to peer {peer_id!r}")
        if pool is None:
            raise ValueError(f"unknown local pool {local_pool!r}")
        remote = conn.remote_pools.get(remote_pool)
        if remote is None:
            raise ValueError(f"peer {peer_id!r} has no pool {remote_pool!r}")
        total = validate_ops(ops, pool.info.nbytes, remote.nbytes)
        lh, rh = conn.local_handles[local_pool], conn.remote_handles[remote_pool]
        assign = [(lh, rh, op.remote_offset, op.local_offset, op.length) for op in ops]
        parts: list[Any] = []
        error = None
        with conn.lock:
            if conn.closed:
                raise TransferError(f"connection to peer {peer_id!r} is closed")
            for i in range(0, len(assign), MAX_ASSIGNMENTS_PER_CALL):
                try:
                    parts.append(
                        self._start_read(conn.endpoint, assign[i : i + MAX_ASSIGNMENTS_PER_CALL])
                    )
                except Exception as exc:  # parts already issued stay tracked
                    error = f"issuing read to {peer_id!r} failed: {exc}"
                    break
            fut = TransferFuture(
                parts,
                self._check_part,
                keepalive=(pool.tensor, conn.endpoint),
                nbytes=total,
                error=error,
            )
            conn.futures.add(fut)
        return fut

    # -- lifecycle -------------------------------------------------------------------
    def close(self) -> None:
        with self._connect_lock:
            if self._closed:
                return
            self._closed = True
            for table in (self._peers, self._accepted):
                for peer_id in list(table):
                    self._teardown(table, peer_id, "transfer engine closed")
            with self._lock:
                self._pools.clear()

    def _ensure_open(self) -> None:
        if self._closed:
            raise TransferError("transfer engine is closed")

    def _open_conn(self) -> _Conn:
        endpoint = self._new_endpoint()
        try:
            with self._lock:
                pools = list(self._pools.items())
            handles = {n: self._register(endpoint, n, p.tensor, p.info.nbytes) for n, p in pools}
        except BaseException:
            endpoint.shutdown()
            raise
        return _Conn(endpoint=endpoint, local_handles=handles)

    @staticmethod
    def _register(endpoint: Any, name: str, tensor: torch.Tensor, nbytes: int) -> int:
        handle = endpoint.register_memory_region(name, tensor.data_ptr(), 0, nbytes)
        if handle < 0:
            raise TransferError(f"dlslime refused to register pool {name!r}")
        return handle

    def _teardown(self, table: dict[str, _Conn], peer_id: str, reason: str) -> None:
        with self._lock:
            conn = table.pop(peer_id, None)
        if conn is None:
            return
        with conn.lock:
            conn.closed = True
            conn.endpoint.shutdown()  # joins the I/O thread: nothing is written after this
            for fut in list(conn.futures):
                fut._abort(reason)
