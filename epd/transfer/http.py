"""HTTP handshake for the transfer layer.

Producer: `app.include_router(make_transfer_router(engine))` serves
`POST /v1/transfer/connect` (`HandshakeRequest` -> `HandshakeResponse` via
`engine.accept`). Consumer: `engine.connect(producer_id, http_handshake(url, my_id))`.
Errors are OpenAI-format JSON: 400 for a backend mismatch or bad endpoint info,
503 when the engine cannot set up the endpoint.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
from fastapi import APIRouter
from fastapi.responses import JSONResponse

from epd.transfer.base import TransferEngine, TransferError
from epd.transfer.messages import HandshakeRequest, HandshakeResponse

CONNECT_PATH = "/v1/transfer/connect"


def _error(status: int, message: str, param: str | None, code: str) -> JSONResponse:
    err_type = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": err_type, "param": param, "code": code}}
    return JSONResponse(status_code=status, content=body)


def make_transfer_router(engine: TransferEngine) -> APIRouter:
    router = APIRouter()

    # Sync handler: accept() may block on endpoint setup, so FastAPI runs it in a thread.
    @router.post(CONNECT_PATH, response_model=HandshakeResponse)
    def transfer_connect(req: HandshakeRequest):
        if req.backend != engine.name:
            return _error(
                400,
                f"transfer backend mismatch: peer uses {req.backend!r}, this server {engine.name!r}",
                "backend",
                "transfer_backend_mismatch",
            )
        if not isinstance(req.info.get("endpoint"), dict):
            return _error(
                400, "info.endpoint must be an object", "info.endpoint", "invalid_endpoint_info"
            )
        try:
            return HandshakeResponse.model_validate(engine.accept(req.peer_id, req.info))
        except TransferError as exc:
            return _error(503, f"transfer handshake failed: {exc}", None, "transfer_unavailable")

    return router


def http_handshake(base_url: str, peer_id: str, timeout_s: float = 10) -> Callable[[dict], dict]:
    """A handshake function for `TransferEngine.connect` that POSTs to a producer.

    `peer_id` is the id the *caller* presents to the producer (its own engine id);
    the producer keys its per-peer endpoint on it.
    """
    url = base_url.rstrip("/") + CONNECT_PATH

    def handshake(info: dict) -> dict:
        req = HandshakeRequest(peer_id=peer_id, backend=str(info.get("backend", "")), info=info)
        try:
            resp = httpx.post(
                url,
                content=req.model_dump_json(),
                timeout=timeout_s,
                headers={"content-type": "application/json"},
            )
        except httpx.HTTPError as exc:
            raise TransferError(f"transfer handshake with {url} failed: {exc!r}") from exc
        if resp.status_code != 200:
            raise TransferError(
                f"transfer handshake with {url} failed: HTTP {resp.status_code}: {resp.text[:500]}"
            )
        return HandshakeResponse.model_validate_json(resp.content).model_dump(mode="json")

    return handshake
