"""Transfer layer: dlslime data plane (tcp / rdma / nvlink) plus ZMQ release acks.

Public surface: `ReadOp`, `merge_block_ops`, `validate_ops`, `TransferFuture`,
`TransferEngine`, `TransferError` (`epd.transfer.base`); the wire models `Ack`, `PoolInfo`,
`HandshakeRequest`, `HandshakeResponse` (`epd.transfer.messages`); `create_transfer_engine`,
`available_backends` (`epd.transfer.registry`); `AckListener`, `AckSender`, `DROP_ACKS_ENV`
(`epd.transfer.acks`); `make_transfer_router`, `http_handshake`, `CONNECT_PATH`
(`epd.transfer.http`).

Importing this package is cheap (stdlib + pydantic): the registry (torch, dlslime), the
acks (zmq) and the HTTP handshake (fastapi, httpx) are imported on first access of one of
their names, and dlslime itself only when a backend is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from epd.transfer.base import (
    ReadOp,
    TransferEngine,
    TransferError,
    TransferFuture,
    merge_block_ops,
    validate_ops,
)
from epd.transfer.messages import Ack, HandshakeRequest, HandshakeResponse, PoolInfo

if TYPE_CHECKING:
    from epd.transfer.acks import DROP_ACKS_ENV, AckListener, AckSender
    from epd.transfer.http import CONNECT_PATH, http_handshake, make_transfer_router
    from epd.transfer.registry import available_backends, create_transfer_engine

_LAZY = {
    "available_backends": "epd.transfer.registry",
    "create_transfer_engine": "epd.transfer.registry",
    "AckListener": "epd.transfer.acks",
    "AckSender": "epd.transfer.acks",
    "DROP_ACKS_ENV": "epd.transfer.acks",
    "CONNECT_PATH": "epd.transfer.http",
    "http_handshake": "epd.transfer.http",
    "make_transfer_router": "epd.transfer.http",
}

__all__ = [
    "CONNECT_PATH",
    "DROP_ACKS_ENV",
    "Ack",
    "AckListener",
    "AckSender",
    "HandshakeRequest",
    "HandshakeResponse",
    "PoolInfo",
    "ReadOp",
    "TransferEngine",
    "TransferError",
    "TransferFuture",
    "available_backends",
    "create_transfer_engine",
    "http_handshake",
    "make_transfer_router",
    "merge_block_ops",
    "validate_ops",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
