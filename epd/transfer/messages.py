"""Pydantic models for everything the transfer layer sends over a socket.

JSON only (`model_dump_json` / `model_validate_json`), never pickle. Unknown fields
are rejected so a malformed or mismatched peer fails loudly at the boundary.

Handshake (HTTP `POST /v1/transfer/connect`, see `epd.transfer.http`):
the consumer sends `HandshakeRequest(peer_id=<its engine id>, backend, info)` where
`info` is what its engine's `connect` handed to the handshake function; the producer
answers `HandshakeResponse(peer_id=<its engine id>, backend, info, pools)`: `info`
carries the producer endpoint's dlslime `endpoint_info` (incl. memory regions), `pools`
the metadata of every registered pool.

Acks (ZMQ PUSH -> PULL, see `epd.transfer.acks`): `Ack(kind="release", lease_ids, ...)`
tells the producer that the consumer is done with the leased blocks.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PoolInfo(_Msg):
    nbytes: int = Field(ge=0)
    block_nbytes: int = Field(ge=0)
    num_blocks: int = Field(ge=0)
    dtype: str


class HandshakeRequest(_Msg):
    peer_id: str = Field(min_length=1)
    backend: str
    info: dict[str, Any]


class HandshakeResponse(_Msg):
    peer_id: str = Field(min_length=1)
    backend: str
    info: dict[str, Any]
    pools: dict[str, PoolInfo]


class Ack(_Msg):
    kind: Literal["release"]
    lease_ids: list[str]
    consumer_id: str
    ok: bool = True
    detail: str = ""
