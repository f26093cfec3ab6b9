"""RDMA backend: dlslime `RDMAEndpoint` (one queue pair set per peer connection).

Available only when `dlslime.available_nic()` lists a NIC. Not exercised by the test
suite (no RDMA NIC on CI machines); it follows the dlslime 0.1.23 API:
`RDMAEndpoint(device_name, ib_port, link_type, num_qp)`,
`register_memory_region(name, ptr, offset, length) -> handle`, `endpoint_info()` (with
`mr_info`), `connect(peer_info)` on *both* sides, `register_remote_memory_region(name,
mr_info) -> handle`, `read([(local, remote, remote_off, local_off, len), ...])`.

Its read future only has a blocking, core-spinning `wait()` (no `wait_for`), so each
read call gets a small daemon thread that waits and records the status; `poll()` reads
that. CUDA tensors are allowed (GPUDirect RDMA needs the peer-memory kernel module).
"""

from __future__ import annotations

import threading
from typing import Any

from epd.transfer.base import TransferError
from epd.transfer.dlslime_engine import DlslimeTransferEngine


def unavailable_reason() -> str | None:
    try:
        import dlslime
    except Exception as exc:
        return f"cannot import dlslime: {exc}"
    if not getattr(dlslime._slime_c, "_BUILD_RDMA", False):
        return "dlslime was built without RDMA"
    try:
        nics = dlslime.available_nic()
    except Exception as exc:
        return f"dlslime.available_nic() failed: {exc}"
    if not nics:
        return "no RDMA NIC found (dlslime.available_nic() is empty)"
    return None


class _RdmaPart:
    """A dlslime read future waited on by a daemon thread."""

    def __init__(self, future: Any) -> None:
        self.result_code: int | None = None
        self._future = future
        threading.Thread(target=self._wait, name="epd-rdma-wait", daemon=True).start()

    def _wait(self) -> None:
        try:
            self.result_code = int(self._future.wait())
        except Exception:
            self.result_code = -1


class RdmaTransferEngine(DlslimeTransferEngine):
    name = "rdma"

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        engine_id: str | None = None,
        device_name: str | None = None,
        ib_port: int = 1,
        link_type: str = "auto",
        num_qp: int = 1,
    ) -> None:
        reason = unavailable_reason()
        if reason:
            raise TransferError(f"rdma transfer backend unavailable: {reason}")
        import dlslime

        nics = dlslime.available_nic()
        if device_name is not None and device_name not in nics:
            raise TransferError(f"RDMA device {device_name!r} not found; available: {nics}")
        self.device_name = device_name or nics[0]
        self.ib_port = ib_port
        self.link_type = link_type
        self.num_qp = num_qp
        # `host` only labels this engine in local_info(): RDMA addressing comes from the NIC.
        super().__init__(host, engine_id=engine_id)

    def _new_endpoint(self) -> Any:
        import dlslime

        return dlslime.RDMAEndpoint(
            device_name=self.device_name,
            ib_port=self.ib_port,
            link_type=self.link_type,
            num_qp=self.num_qp,
        )

    def _start_read(self, endpoint: Any, assign: list[tuple[int, int, int, int, int]]) -> Any:
        return _RdmaPart(endpoint.read(assign))

    def _check_part(self, part: _RdmaPart) -> int | None:
        return part.result_code
