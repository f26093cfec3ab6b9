"""`epd serve --role encoder`: the encoder's HTTP server.

Endpoints: `POST /v1/encode` (content parts -> `encoder_result` with leased feature
blocks), `POST /v1/encode/release`, `POST /v1/transfer/connect` (transfer handshake),
`GET /health`, `GET /metrics` (Prometheus), `GET /v1/encode/stats` (debug, for tests).

Invariants:
- The feature pool (`MMCache.tensor`) is registered once with the transfer engine under
  `pool_name`; consumers read block ids from it after the handshake.
- Leases end by a ZMQ ack (`AckListener` bound on `--host`, hopped onto the event loop),
  by `/v1/encode/release`, or by expiry; all three are idempotent.
- HTTP, ZMQ and the data plane bind the configured host (default 127.0.0.1). The
  dlslime data plane has no authentication: expose it only to trusted peers.
- Every bad input is an OpenAI-format 4xx naming `content[j]`; the request's refs are
  released on any failure, so nothing leaks and the server keeps serving.
- A missing proxy never stops the encoder: registration retries in the background.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI
from fastapi.responses import Response

from epd.encoder.config import (
    DEFAULT_MM_CACHE_MEMORY,
    DTYPES,
    TRANSFER_KINDS,
    EncoderConfig,
)
from epd.encoder.engine import EncoderEngine
from epd.encoder.media import MediaConfig, collect_content_image_parts, load_images
from epd.errors import install_error_handlers, invalid_request
from epd.netutil import parse_bytes, register_with_proxy
from epd.protocol import (
    EncodeRequest,
    EncodeResponse,
    EncoderResult,
    ReleaseRequest,
    ReleaseResponse,
)

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser, role: str = "encoder") -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory (HF layout)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (HTTP, ZMQ, data plane)")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--ack-port", type=int, default=0, help="ZMQ ack port (0: any free port)")
    parser.add_argument("--proxy-url", default=None, help="register with this proxy at start")
    parser.add_argument("--transfer", choices=TRANSFER_KINDS, default="auto")
    parser.add_argument("--max-batch-images", type=int, default=16)
    parser.add_argument("--batch-window-ms", type=float, default=3.0)
    parser.add_argument("--mm-block-tokens", type=int, default=16)
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--mm-cache-memory", type=parse_bytes, default=DEFAULT_MM_CACHE_MEMORY,
        help="feature pool size, e.g. 256MiB (default)",
    )
    size.add_argument("--mm-num-blocks", type=int, default=None, help="feature pool size in blocks")
    parser.add_argument("--lease-seconds", type=float, default=60.0)
    parser.add_argument("--alloc-timeout-seconds", type=float, default=5.0)
    parser.add_argument("--allowed-local-media-path", default=None)
    parser.add_argument(
        "--allowed-media-domains", nargs="+", default=None, help="host names (space/comma separated)"
    )
    parser.add_argument("--limit-images-per-request", type=int, default=8)
    parser.add_argument("--dtype", choices=DTYPES, default="auto")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    parser.add_argument("--encoder-id", default=None, help="default: a random id")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def config_from_args(args: argparse.Namespace) -> EncoderConfig:
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    domains = None
    if args.allowed_media_domains:
        domains = tuple(d for item in args.allowed_media_domains for d in item.split(",") if d)
    extra: dict[str, Any] = {"encoder_id": args.encoder_id} if args.encoder_id else {}
    return EncoderConfig(
        model=args.model, host=args.host, port=args.port, ack_port=args.ack_port,
        proxy_url=args.proxy_url, transfer=args.transfer, max_batch_images=args.max_batch_images,
        batch_window_ms=args.batch_window_ms, mm_block_tokens=args.mm_block_tokens,
        mm_cache_memory=args.mm_cache_memory, mm_num_blocks=args.mm_num_blocks,
        lease_seconds=args.lease_seconds, alloc_timeout_seconds=args.alloc_timeout_seconds,
        allowed_local_media_path=args.allowed_local_media_path, allowed_media_domains=domains,
        limit_images_per_request=args.limit_images_per_request, dtype=args.dtype, device=device,
        log_level=args.log_level, **extra,
    )


def media_config(config: EncoderConfig) -> MediaConfig:
    return MediaConfig(
        allowed_local_media_path=config.allowed_local_media_path,
        allowed_media_domains=config.allowed_media_domains,
        limit_images_per_request=config.limit_images_per_request,
    )


def create_app(config: EncoderConfig, engine: EncoderEngine | None = None) -> FastAPI:
    from epd.transfer import create_transfer_engine
    from epd.transfer.acks import AckListener
    from epd.transfer.http import make_transfer_router

    engine = engine or EncoderEngine(config)
    transfer = create_transfer_engine(config.transfer, config.host, engine_id=config.encoder_id)
    transfer.register_pool(config.pool_name, engine.cache.tensor)
    media = media_config(config)
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        loop = asyncio.get_running_loop()

        def on_ack(ack: Any) -> None:  # the listener's thread: hop onto the event loop
            if not ack.ok:
                logger.info("consumer %s acked a failed read: %s", ack.consumer_id, ack.detail)
            try:
                loop.call_soon_threadsafe(engine.release, list(ack.lease_ids))
            except RuntimeError:  # the loop closed while shutting down
                pass

        acks = AckListener(config.host, config.ack_port, on_ack=on_ack)
        state["ack_address"] = acks.address
        state["client"] = httpx.AsyncClient(timeout=media.fetch_timeout_s)
        tasks = []
        if config.proxy_url:
            tasks.append(asyncio.create_task(register_with_proxy(config.proxy_url, config.url, "encoder", attempts=None)
            ))
        logger.info(
            "encoder %s serving on %s (transfer %s, pool %r, acks at %s)",
            config.encoder_id, config.url, transfer.name, config.pool_name, acks.address,
        )
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            acks.close()
            await state["client"].aclose()
            await engine.stop()
            transfer.close()

    app = FastAPI(title="epd encoder", lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(make_transfer_router(transfer))
    app.state.engine = engine
    app.state.transfer = transfer

    @app.post("/v1/encode", response_model=EncodeResponse)
    async def encode(req: EncodeRequest) -> EncodeResponse:
        refs = collect_content_image_parts(req.content, limit=config.limit_images_per_request)
        if not refs:
            raise invalid_request("the content has no image_url part to encode", "content")
        images = await load_images(refs, media, state["client"])
        features = await engine.encode(images, [r.param for r in refs], holder=req.request_id or "")
        try:
            result = EncoderResult(
                encoder_id=config.encoder_id, encoder_url=config.url,
                transfer_backend=transfer.name, pool_name=config.pool_name,
                ack_address=state["ack_address"], images=features,
            )
        except Exception:
            engine.release(f.lease_id for f in features)
            raise
        return EncodeResponse(encoder_result=result)

    @app.post("/v1/encode/release", response_model=ReleaseResponse)
    async def release(req: ReleaseRequest) -> ReleaseResponse:
        return ReleaseResponse(released=engine.release(req.lease_ids))

    @app.get("/v1/encode/stats")
    async def stats() -> dict[str, Any]:
        return engine.stats()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok", "role": "encoder", "encoder_id": config.encoder_id,
            "model": config.model, "url": config.url, "transfer_backend": transfer.name,
            "pool_name": config.pool_name, "ack_address": state.get("ack_address"),
            "pool": engine.stats(),
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=engine.metrics.content_type)

    return app


def run(args: argparse.Namespace) -> int:
    import uvicorn

    config = config_from_args(args)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = create_app(config)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level)
    return 0
