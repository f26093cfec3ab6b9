"""The HTTP side of the prefill and decode roles (`epd serve --role prefill|decode`).

Contract (the proxy codes against it):
- Prefill: `POST /v1/chat/completions` (or `/v1/completions`) with `"prefill_only": true`
  (and `encoder_result` for image requests, as role llm accepts it) -> 200
  `PrefillResponse` JSON {"id", "migration_request", "usage"} as soon as the first token
  is sampled (`stream` is ignored: the answer is always JSON). The KV blocks stay held
  under a lease (`--lease-seconds`) until the decode engine's ZMQ ack, `POST
  /v1/prefill/release {"lease_ids": [...]}` or expiry. Without `prefill_only` -> 400
  naming `prefill_only`.
- Decode: the client's body plus `"migration_request"` -> the normal OpenAI response or
  SSE stream, whose first token is the prefill's. Image parts are never loaded: their
  placeholder spans come from `migration_request.mm_spans`. Without `migration_request`
  -> 400 naming `migration_request`; a failed KV read -> 502, code `pd_migration`.
- Role llm refuses both fields (400 naming the field).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse

from epd.errors import EPDError, invalid_request
from epd.protocol import PrefillResponse, ReleaseRequest, ReleaseResponse, Usage

RELEASE_PATH = "/v1/prefill/release"


def check_role(role: str, req: Any) -> None:
    """400 naming `prefill_only` / `migration_request` when the request does not fit the role."""
    if role == "llm":
        if req.migration_request is not None or req.prefill_only:
            param = "migration_request" if req.migration_request is not None else "prefill_only"
            raise invalid_request(
                f"{param} (prefill/decode disaggregation) needs a server started with "
                "--role prefill / --role decode; this is --role llm", param)
    elif role == "prefill":
        if req.migration_request is not None:
            raise invalid_request("this is a prefill engine (--role prefill): it never decodes "
                                  "a migration_request; send it to a decode engine",
                                  "migration_request")
        if not req.prefill_only:
            raise invalid_request(
                "this is a prefill engine (--role prefill): requests must set prefill_only: "
                "true (send client requests to the epd proxy, which does)", "prefill_only")
    elif role == "decode":
        if req.prefill_only:
            raise invalid_request("this is a decode engine (--role decode): it never serves "
                                  "prefill_only requests", "prefill_only")
        if req.migration_request is None:
            raise invalid_request(
                "this is a decode engine (--role decode): requests must carry the prefill's "
                "migration_request (send client requests to the epd proxy, which does)",
                "migration_request")


async def prepare_decode_chat(serving: Any, req: Any) -> Any:
    """Decode role: the chat prompt rebuilt from the messages and the prefill's image
    spans (no image is loaded), then checked against the migration by the engine."""
    from epd.llm.pd.validate import decode_prompt
    from epd.protocol import new_id

    mr = req.migration_request
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    try:
        ids, items = await asyncio.to_thread(decode_prompt, serving.processor, messages, mr)
    except ValueError as exc:
        raise invalid_request(f"cannot build the prompt: {exc}",
                              "migration_request.mm_spans", "migration_request_mismatch") from None
    ereq = serving._finish_prepare(new_id("chatcmpl"), ids, req, "messages", items)
    ereq.migration = mr
    return ereq


async def prefill_response(serving: Any, ereq: Any, outputs: Any) -> JSONResponse:
    """Prefill role: run the prefill, answer the PrefillResponse."""
    final = None
    async for out in outputs:
        if out.finished:
            final = out
    if final is None or final.migration is None:
        detail = final.error if final is not None else "no output"
        raise EPDError(f"prefill failed: {detail}", type="internal_error", status=500)
    usage = Usage.of(final.num_prompt_tokens, 1, final.num_cached_tokens)
    body = PrefillResponse(id=ereq.request_id, migration_request=final.migration, usage=usage)
    return JSONResponse(body.model_dump(mode="json", exclude_none=True))


def add_pd_routes(app: FastAPI, engine: Any, role: str) -> None:
    """`POST /v1/prefill/release` (prefill role) and `POST /v1/transfer/connect` (both)."""
    from epd.transfer import make_transfer_router

    llm = engine.engine
    router = APIRouter()
    if role == "prefill":

        @router.post(RELEASE_PATH)
        async def release(req: ReleaseRequest) -> dict:
            released = llm.pd_out.release(list(req.lease_ids))
            return ReleaseResponse(released=released).model_dump()

    app.include_router(router)
    app.include_router(make_transfer_router(llm.hub.transfer))
