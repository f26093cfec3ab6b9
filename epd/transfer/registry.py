"""Transfer backend registry: `create_transfer_engine(kind)` and `available_backends()`.

`auto` prefers nvlink > rdma > tcp, taking the first available and logging why. Both
sides of a connection must end up on the same backend (the handshake rejects a
mismatch), so multi-host deployments should name the backend explicitly.
"""

from __future__ import annotations

import logging

from epd.transfer import nvlink, rdma, tcp
from epd.transfer.base import TransferEngine

logger = logging.getLogger(__name__)

_BACKENDS = {
    "nvlink": (nvlink.unavailable_reason, nvlink.NvlinkTransferEngine),
    "rdma": (rdma.unavailable_reason, rdma.RdmaTransferEngine),
    "tcp": (tcp.unavailable_reason, tcp.TcpTransferEngine),
}
AUTO_ORDER = ("nvlink", "rdma", "tcp")


def available_backends() -> dict[str, str | None]:
    """Backend name -> None if usable here, else the reason it is not."""
    return {name: check() for name, (check, _) in _BACKENDS.items()}


def create_transfer_engine(
    kind: str = "auto", host: str = "127.0.0.1", *, engine_id: str | None = None
) -> TransferEngine:
    if kind == "auto":
        reasons = available_backends()
        for name in AUTO_ORDER:
            if reasons[name] is None:
                skipped = "; ".join(
                    f"{n}: {reasons[n]}" for n in AUTO_ORDER[: AUTO_ORDER.index(name)]
                )
                logger.info(
                    "transfer backend auto -> %s%s",
                    name,
                    f" (skipped {skipped})" if skipped else "",
                )
                kind = name
                break
        else:
            raise ValueError(f"no transfer backend available: {reasons}")
    if kind not in _BACKENDS:
        raise ValueError(
            f"unknown transfer backend {kind!r}; choose from auto, {', '.join(_BACKENDS)}"
        )
    return _BACKENDS[kind][1](host, engine_id=engine_id)
