"""TCP backend: dlslime `TcpEndpoint` over host memory.

- Always binds the configured host (dlslime's default is 0.0.0.0). The host must be a
  concrete local IP address: it is advertised to peers in `endpoint_info`, and dlslime
  silently falls back to a wildcard bind if its bind fails, so both are checked here.
- Every endpoint listens on an ephemeral port and its server returns any address it is
  asked for, with no authentication and no range check (ranges are checked by
  `read` on the consumer side only). Operators: the data-plane host must be reachable
  by trusted peers only (loopback, a private network, or a firewall).
- This dlslime wheel's TCP transport has no CUDA staging: pools must be CPU tensors.
- Each assignment opens its own TCP connection (dlslime moves the socket out of its
  pool), synchronously, in the caller's thread: against an unreachable-but-not-refusing
  host `read` can block for the kernel's connect timeout.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

import torch

from epd.transfer.base import TransferError
from epd.transfer.dlslime_engine import DlslimeTransferEngine


def unavailable_reason() -> str | None:
    try:
        import dlslime
    except Exception as exc:  # e.g. libibverbs.so.1 missing
        return f"cannot import dlslime: {exc}"
    if not getattr(dlslime._slime_c, "_BUILD_TCP", False):
        return "dlslime was built without its TCP transport"
    return None


def resolve_bind_host(host: str) -> str:
    """The IP literal for `host`; rejects wildcard and non-local addresses."""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        try:
            addr = ipaddress.ip_address(socket.gethostbyname(host))
        except OSError as exc:
            raise TransferError(f"cannot resolve transfer host {host!r}: {exc}") from exc
    if addr.is_unspecified:
        raise TransferError(
            f"transfer host {host!r} is a wildcard address; peers need a concrete one to reach"
        )
    family = socket.AF_INET6 if addr.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((str(addr), 0))
        except OSError as exc:
            raise TransferError(f"transfer host {host!r} is not a local address: {exc}") from exc
    return str(addr)


class TcpTransferEngine(DlslimeTransferEngine):
    name = "tcp"

    def __init__(self, host: str = "127.0.0.1", *, engine_id: str | None = None) -> None:
        reason = unavailable_reason()
        if reason:
            raise TransferError(f"tcp transfer backend unavailable: {reason}")
        super().__init__(resolve_bind_host(host), engine_id=engine_id)

    def _new_endpoint(self) -> Any:
        import dlslime

        return dlslime.TcpEndpoint(self.host, 0)

    def _check_tensor(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu":
            raise ValueError(
                f"the tcp transfer backend serves CPU memory only, got a {tensor.device} tensor"
            )

    def _endpoint_connected(self, endpoint: Any) -> bool:
        return bool(endpoint.is_connected())

    def _check_part(self, part: Any) -> int | None:
        return part.wait_for(0)  # seconds; None while in flight, else the status
