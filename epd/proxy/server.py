"""`epd proxy`: the OpenAI-compatible front door.

Chat requests with image_url parts go encoder(s) -> LLM node; text-only requests go straight
to an LLM node. In PD mode (`--mode pd`, or auto with prefill/decode nodes and no healthy
llm node) the LLM node is replaced by prefill -> decode (`epd.proxy.pd`). The proxy validates only what it needs to route (a JSON object body); the
LLM node validates the rest and its 4xx answers reach the client unchanged.

Invariants: one shared httpx.AsyncClient (pooled, trust_env=False: no proxies from the
environment); the EPD extension fields are set only by the proxy (a client sending them gets
a 400); the listening socket binds --host (default 127.0.0.1).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import time
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from epd.errors import (
    EPDError,
    error_response,
    install_error_handlers,
    invalid_request,
    service_unavailable,
)
from epd.protocol import ModelCard, ModelList
from epd.proxy.config import ROLES, STRATEGIES, ProxyConfig
from epd.proxy.metrics import CONTENT_TYPE, ProxyMetrics
from epd.proxy.orchestrator import Encoded, EncodeStage, collect_images
from epd.proxy.pd import PDFlow, check_pd_body
from epd.proxy.registry import HealthFn, Node, NodeRegistry, RoleConflict, http_health_fn
from epd.proxy.relay import ClientGone, PassThrough, Relay, passthrough
from epd.proxy.routing import make_routers

logger = logging.getLogger("epd.proxy")

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# Set by the proxy for the nodes; a client must not point an engine at arbitrary peers.
_INTERNAL_FIELDS = ("encoder_result", "migration_request", "prefill_only")


class NodeAdd(BaseModel):
    url: str
    role: str


class NodeRemove(BaseModel):
    url: str


class Proxy:
    """Everything one proxy app holds; built in the app's lifespan."""

    def __init__(self, config: ProxyConfig, client: httpx.AsyncClient, health_fn: HealthFn):
        self.config = config
        self.client = client
        self.registry = NodeRegistry(config.failure_threshold, health_fn)
        self.routers = make_routers(config.routing_for)
        self.metrics = ProxyMetrics(
            healthy_count=lambda role: len(self.registry.healthy(role)),
            in_flight=lambda role: sum(n.in_flight for n in self.registry.nodes(role)),
        )
        timeout = httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s)
        self.encode_stage = EncodeStage(
            client, self.registry, self.routers["encoder"], self.metrics, timeout
        )
        self.relay = Relay(client, self.registry, self.metrics, timeout)
        self.pd_flow = PDFlow(
            client, self.registry, self.metrics, self.relay, self.encode_stage, timeout
        )
        self._tasks: set[asyncio.Task] = set()
        for url, role in config.nodes:
            self.registry.add(url, role)

    def check_soon(self, node: Node) -> None:
        task = asyncio.ensure_future(self.registry.check(node))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def use_pd(self) -> bool:
        """--mode pd: always; colocated: never; auto: when no healthy llm node exists and
        prefill or decode nodes are registered."""
        mode, reg = self.config.mode, self.registry
        if mode != "auto":
            return mode == "pd"
        return not reg.healthy("llm") and bool(reg.nodes("prefill") or reg.nodes("decode"))

    def pick(self, role: str) -> Node:
        node = self.routers[role].choose(self.registry.healthy(role))
        if node is None:
            raise _no_node(role, len(self.registry.nodes(role)))
        return node

    async def handle(self, request: Request, path: str) -> Response:
        t0 = time.perf_counter()
        encoded = Encoded()
        try:
            body = await _parse_body(request)
            slots = collect_images(body) if path == CHAT else []
            pd = self.use_pd()
            if pd:
                check_pd_body(body)
                nodes = [self.pick("prefill"), self.pick("decode")]
                label = "epd_pd" if slots else "pd"
            else:
                nodes = [self.pick("llm")]
                label = "image" if slots else "text"
            if slots and not self.registry.healthy("encoder"):
                raise _no_node("encoder", len(self.registry.nodes("encoder")))
            self.metrics.requests.labels(label).inc()
            if slots:
                encoded = await self.encode_stage.encode(slots)
                body = encoded.attach_to(body)
            if pd:
                return await self.pd_flow.run(
                    request, *nodes, path, body, encoded, label=label, t0=t0
                )
            return await self.relay.forward(
                request,
                nodes[0],
                path,
                body,
                stage="llm",
                label=label,
                on_failure=lambda: self.encode_stage.release(encoded),
                t0=t0,
            )
        except EPDError as e:
            self.metrics.errors.labels(e.code or e.type).inc()
            return error_response(e)
        except PassThrough as p:
            self.metrics.errors.labels(f"upstream_{p.status_code}").inc()
            return p.response()
        except ClientGone:
            self.metrics.errors.labels("client_disconnect").inc()
            return Response(status_code=499)


def _no_node(role: str, registered: int) -> EPDError:
    return service_unavailable(
        f"No healthy '{role}' node is available ({registered} registered); "
        f"start one with `epd serve --role {role} --proxy-url <this proxy>`.",
        retry_after_s=1,
    )


async def _parse_body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError):
        raise invalid_request("The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    for name in _INTERNAL_FIELDS:
        if body.get(name) not in (None, False):
            raise invalid_request(f"'{name}' is set by the proxy, not by clients.", name)
    return body


def create_app(
    config: ProxyConfig,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    health_fn: HealthFn | None = None,
) -> FastAPI:
    """The proxy app. `transport` / `health_fn` replace the network in unit tests."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        client = httpx.AsyncClient(
            trust_env=False,
            transport=transport,
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=128),
        )
        proxy = Proxy(config, client, health_fn or http_health_fn(client, config.health_timeout_s))
        app.state.proxy = proxy
        loop = asyncio.ensure_future(proxy.registry.run_health_loop(config.health_interval_s))
        try:
            yield
        finally:
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop
            await client.aclose()

    app = FastAPI(title="epd proxy", lifespan=lifespan)
    install_error_handlers(app)

    def proxy_of(request: Request) -> Proxy:
        return request.app.state.proxy

    @app.post(CHAT)
    async def chat(request: Request) -> Response:
        return await proxy_of(request).handle(request, CHAT)

    @app.post(COMPLETIONS)
    async def completions(request: Request) -> Response:
        return await proxy_of(request).handle(request, COMPLETIONS)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        proxy = proxy_of(request)
        if config.served_model_name:
            card = ModelCard(id=config.served_model_name)
            return JSONResponse(ModelList(data=[card]).model_dump())
        for role in ("llm", "prefill", "decode"):
            for node in proxy.registry.healthy(role):
                try:
                    r = await proxy.client.get(f"{node.url}/v1/models", timeout=10.0)
                except httpx.HTTPError as e:
                    proxy.registry.record_failure(node, f"models: {type(e).__name__}: {e}")
                    continue
                return passthrough(r).response()
        raise _no_node("llm", len(proxy.registry.nodes("llm")))

    @app.get("/health")
    async def health(request: Request) -> dict:
        proxy = proxy_of(request)
        return {"status": "ok", "mode": config.mode, "nodes": proxy.registry.counts()}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(proxy_of(request).metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/nodes")
    async def nodes(request: Request) -> dict:
        return {"nodes": [n.to_dict() for n in proxy_of(request).registry.nodes()]}

    @app.post("/nodes/add")
    async def nodes_add(req: NodeAdd, request: Request) -> dict:
        proxy = proxy_of(request)
        try:
            node, created = proxy.registry.add(req.url, req.role)
        except RoleConflict as e:
            raise EPDError(str(e), param="role", code="role_conflict", status=409) from None
        except ValueError as e:
            raise invalid_request(str(e), "role" if "role" in str(e) else "url") from None
        if created:
            proxy.check_soon(node)
        return {"url": node.url, "role": node.role, "created": created}

    @app.post("/nodes/remove")
    async def nodes_remove(req: NodeRemove, request: Request) -> dict:
        try:
            removed = proxy_of(request).registry.remove(req.url)
        except ValueError as e:
            raise invalid_request(str(e), "url") from None
        return {"url": req.url, "removed": removed}

    return app


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    parser.add_argument("--port", type=int, default=8080)
    for role in ROLES:
        parser.add_argument(
            f"--{role}",
            action="append",
            default=[],
            metavar="URL",
            help=f"{role} node (repeatable)",
        )
    parser.add_argument("--routing", choices=STRATEGIES, default="round_robin")
    for role in ROLES:
        parser.add_argument(
            f"--{role}-routing", choices=STRATEGIES, default=None, help=f"override for {role}"
        )
    parser.add_argument("--mode", choices=("auto", "colocated", "pd"), default="auto")
    parser.add_argument("--health-interval", type=float, default=2.0, metavar="SECONDS")
    parser.add_argument("--health-timeout", type=float, default=2.0, metavar="SECONDS")
    parser.add_argument(
        "--failure-threshold",
        type=int,
        default=2,
        help="consecutive failures that take a node out of rotation",
    )
    parser.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error")
    )


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    nodes = tuple((url, role) for role in ROLES for url in getattr(args, role))
    overrides = tuple(
        (role, getattr(args, f"{role}_routing"))
        for role in ROLES
        if getattr(args, f"{role}_routing")
    )
    return ProxyConfig(
        host=args.host,
        port=args.port,
        nodes=nodes,
        routing=args.routing,
        role_routing=overrides,
        mode=args.mode,
        health_interval_s=args.health_interval,
        health_timeout_s=args.health_timeout,
        failure_threshold=args.failure_threshold,
        request_timeout_s=args.request_timeout,
        served_model_name=args.served_model_name,
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"epd proxy: {e}")
        return 2
    nodes = ", ".join(f"{role}={url}" for url, role in config.nodes) or "none yet"
    logger.info(
        "epd proxy on http://%s:%d (mode %s; nodes: %s)",
        config.host,
        config.port,
        config.mode,
        nodes,
    )
    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level=args.log_level.lower(),
        access_log=args.log_level.lower() == "debug",
    )
    return 0
