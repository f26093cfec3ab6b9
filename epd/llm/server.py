"""`epd serve --role llm`: the LLM engine's OpenAI-compatible HTTP server.

Invariants:
- The engine steps in its own thread (`AsyncLLMEngine`); uvicorn serves this FastAPI app
  in the main thread and turns SIGTERM/SIGINT into a graceful shutdown, after which the
  engine is shut down (lifespan exit).
- Binds `--host` (default 127.0.0.1), never 0.0.0.0 unless asked.
- A client that goes away (streaming or not) aborts its sequence: the blocks it held are
  freed. Every error is OpenAI JSON (epd.errors) and is counted in `/metrics` by type.
- `--proxy-url` registration runs in the background with retries; a proxy that is down
  never stops the server.
- EPD: chat requests with `encoder_result` pull image features from the encoder over the
  transfer layer (`--transfer`, bound to `--host`; created on the first such request).
  The dlslime data plane has no authentication: expose `--host` to trusted peers only.
- PD (`--role prefill` / `--role decode`): see `epd.llm.pd.serving` for the contract.
  Both roles register their KV cache with the transfer engine at start and serve
  `POST /v1/transfer/connect`; the prefill role also `POST /v1/prefill/release` and a ZMQ
  ack listener (bound to `--host`). The KV data plane is as unauthenticated as above.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from epd import netutil
from epd.errors import install_error_handlers
from epd.llm.metrics import ServerMetrics
from epd.llm.pd.serving import add_pd_routes, prefill_response
from epd.llm.server_args import (  # noqa: F401 (add_arguments: the CLI entry point)
    add_arguments,
    engine_config_from_args,
    media_config_from_args,
)
from epd.llm.serving_chat import OpenAIServing
from epd.llm.serving_completion import completion_response, completion_stream
from epd.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList

logger = logging.getLogger("epd.llm.server")
T = TypeVar("T")
DISCONNECT_POLL_S = 0.2
class ClientDisconnected(Exception):
    pass


async def until_disconnect(aw: Awaitable[T], request: Request) -> T:
    """Await `aw`; if the client goes away first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


class ClosingStreamingResponse(StreamingResponse):
    """Always closes its body iterator, so a disconnect aborts the engine request now."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]


def engine_alive(engine: Any) -> bool:
    value = engine.is_alive
    return bool(value() if callable(value) else value)


def _count_errors(app: FastAPI, metrics: ServerMetrics) -> None:
    """Wrap the installed error handlers so every error response is counted by type."""
    for exc_class, handler in list(app.exception_handlers.items()):

        async def counting(request, exc, _handler=handler):
            response = await _handler(request, exc)
            try:
                etype = json.loads(response.body)["error"]["type"]
            except Exception:
                etype = "unknown"
            metrics.record_error(str(etype))
            return response

        app.exception_handlers[exc_class] = counting


def create_app(
    engine: Any,
    *,
    served_model_name: str,
    vision: str,
    media_config: Any,
    max_model_len: int,
    block_size: int,
    role: str = "llm",
    proxy_url: str | None = None,
    public_url: str | None = None,
) -> FastAPI:
    metrics = ServerMetrics(engine.stats)
    serving = OpenAIServing(engine, served_model_name, vision=vision, media_config=media_config,
                            metrics=metrics, max_model_len=max_model_len, block_size=block_size,
                            role=role)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = None
        if proxy_url and public_url:
            task = asyncio.create_task(netutil.register_with_proxy(proxy_url, public_url, role))
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title=f"epd {role} engine", lifespan=lifespan)
    app.state.serving, app.state.metrics = serving, metrics
    install_error_handlers(app)
    if role in ("prefill", "decode"):
        add_pd_routes(app, engine, role)
    _count_errors(app, metrics)

    async def run_request(ereq, request: Request, stream: bool, collect_fn, stream_fn):
        tracker = metrics.track(ereq.num_prompt_tokens)
        gen = serving.generate(ereq, tracker)
        if ereq.prefill_only:  # always JSON: a PrefillResponse
            try:
                return await until_disconnect(prefill_response(serving, ereq, gen), request)
            except ClientDisconnected:
                return Response(status_code=499)
        if not stream:
            try:
                collected = await until_disconnect(serving.collect_from(gen), request)
            except ClientDisconnected:
                logger.info("client left; aborted %s", ereq.request_id)
                return Response(status_code=499)
            return JSONResponse(collect_fn(collected).model_dump(exclude_none=True))
        try:  # the first output before the headers: engine-side errors still get a 4xx
            first = await until_disconnect(gen.__anext__(), request)
        except ClientDisconnected:
            return Response(status_code=499)
        except StopAsyncIteration:
            first = None
        return ClosingStreamingResponse(stream_fn(_prepend(first, gen)),
                                        media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        ereq = await serving.prepare_chat(req)
        return await run_request(
            ereq, request, req.stream,
            lambda c: serving.chat_response(ereq, req, c),
            lambda outs: serving.chat_stream(ereq, req, outs),
        )

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        ereq = await asyncio.to_thread(serving.prepare_completion, req)
        return await run_request(
            ereq, request, req.stream,
            lambda c: completion_response(serving, ereq, req, c),
            lambda outs: completion_stream(serving, ereq, req, outs),
        )

    @app.get("/v1/models")
    async def models() -> dict:
        card = ModelCard(id=served_model_name, root=str(engine.config.model_dir),
                         max_model_len=max_model_len)
        return ModelList(data=[card]).model_dump()

    @app.get("/health")
    async def health():
        alive = engine_alive(engine)
        body: dict[str, Any] = {"status": "ok" if alive else "unhealthy", "role": role,
                                "model": served_model_name}
        with contextlib.suppress(Exception):
            body["stats"] = dataclasses.asdict(engine.stats())
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        data, content_type = metrics.render()
        return Response(data, media_type=content_type)

    return app


async def _prepend(first: Any, rest: AsyncIterator) -> AsyncIterator:
    try:
        if first is not None:
            yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()  # type: ignore[attr-defined]


def run(args) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    role = getattr(args, "role", "llm")
    if not Path(args.model).is_dir():
        print(f"--model {args.model!r} is not a directory", file=sys.stderr)
        return 2
    from epd.llm.async_engine import AsyncLLMEngine

    try:
        config = engine_config_from_args(args)
        media_config = media_config_from_args(args)
    except ValueError as exc:
        print(f"invalid configuration: {exc}", file=sys.stderr)
        return 2
    engine = AsyncLLMEngine(config)
    engine.start()
    stats = engine.stats()
    max_model_len = _max_model_len(engine)
    logger.info("KV cache: %d blocks of %d tokens (max_model_len %d, %s)", stats.kv_blocks_total,
                config.block_size, max_model_len, _layout_desc(engine))
    served = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    app = create_app(engine, served_model_name=served, vision=args.vision,
                     media_config=media_config, max_model_len=max_model_len,
                     block_size=config.block_size, role=role, proxy_url=args.proxy_url,
                     public_url=netutil.public_url(args.host, args.port))
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level=args.log_level, lifespan="on",
                                           timeout_graceful_shutdown=5))
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then re-raises the signal to the
    # previous handler: make that one a no-op so a requested shutdown exits with 0.
    received: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: received.append(signum))
    try:
        server.run()
    finally:
        engine.shutdown()
    if received:
        logger.info("shut down on %s", signal.Signals(received[0]).name)
    return 0


def _max_model_len(engine: Any) -> int:
    for obj in (engine, getattr(engine, "engine", None)):
        value = getattr(obj, "max_model_len", None)
        if isinstance(value, int):
            return value
    return int(engine.layout.max_model_len)


def _layout_desc(engine: Any) -> str:
    layout = getattr(engine, "layout", None) or getattr(getattr(engine, "engine", None),
                                                        "layout", None)
    if layout is None:
        return "layout unknown"
    return f"{layout.block_nbytes} bytes/block, {layout.total_nbytes / 2**20:.1f} MiB total"
