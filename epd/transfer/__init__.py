"""Transfer layer: dlslime data plane (tcp / rdma / nvlink) plus ZMQ release acks.

Public surface: `ReadOp`, `merge_block_ops`, `TransferFuture`, `TransferEngine`,
`TransferError`, `create_transfer_engine`, `available_backends`, the wire models in
`epd.transfer.messages`, `AckListener` / `AckSender` (`epd.transfer.acks`) and the HTTP
handshake (`epd.transfer.http`). dlslime itself is imported only when a backend is used.
"""

from __future__ import annotations

from epd.transfer.base import (
    ReadOp,
    TransferEngine,
    TransferError,
    TransferFuture,
    merge_block_ops,
    validate_ops,
)
from epd.transfer.messages import Ack, HandshakeRequest, HandshakeResponse, PoolInfo
from epd.transfer.registry import available_backends, create_transfer_engine

__all__ = [
    "Ack",
    "HandshakeRequest",
    "HandshakeResponse",
    "PoolInfo",
    "ReadOp",
    "TransferEngine",
    "TransferError",
    "TransferFuture",
    "available_backends",
    "create_transfer_engine",
    "merge_block_ops",
    "validate_ops",
]
