"""In-process fakes for the proxy unit tests: encoder, LLM, prefill and decode nodes
behind httpx.MockTransport that record every call, and a TestClient factory."""

from __future__ import annotations

import json

import httpx
from fastapi.testclient import TestClient

from epd.proxy.config import ProxyConfig
from epd.proxy.registry import Node
from epd.proxy.server import create_app

ENC1, ENC2, LLM = "http://enc1:1", "http://enc2:2", "http://llm:3"
P1, D1, D2 = "http://p1:4", "http://d1:5", "http://d2:6"
PD_NODES = ((ENC1, "encoder"), (P1, "prefill"), (D1, "decode"))


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}



class FakeNodes:
    """Encoders and an LLM node behind httpx.MockTransport; records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict]] = []
        self.down: set[str] = set()
        self.encoder_error: tuple[int, dict] | None = None
        self.llm_status, self.llm_body = 200, None
        self.broken_stream = False

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        body = json.loads(request.content) if request.content else {}
        self.calls.append((base, request.url.path, body))
        if base in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/v1/encode":
            if self.encoder_error:
                return httpx.Response(self.encoder_error[0], json=self.encoder_error[1])
            images = [
                {"mm_hash": p["image_url"]["url"], "lease_id": f"{base}|{p['image_url']['url']}"}
                for p in body["content"]
            ]
            return httpx.Response(
                200, json={"encoder_result": {"encoder_url": base, "images": images}}
            )
        if request.url.path == "/v1/encode/release":
            return httpx.Response(200, json={"released": len(body["lease_ids"])})
        if request.url.path == "/v1/chat/completions":
            if self.llm_status != 200:
                return httpx.Response(self.llm_status, json=self.llm_body)
            if body.get("stream"):
                return httpx.Response(
                    200, content=self._sse(), headers={"content-type": "text/event-stream"}
                )
            reply = {
                "choices": [{"message": {"content": "ok"}}],
                "epd_timings": {"epd_migration": 0.01},
            }
            return httpx.Response(200, json=reply)
        return httpx.Response(404, json={"error": {"message": "nope"}})

    async def _sse(self):
        for word in ("a", "b"):
            yield f'data: {{"choices":[{{"delta":{{"content":"{word}"}}}}]}}\n\n'.encode()
        if self.broken_stream:
            raise httpx.ReadError("peer closed")
        yield b'data: {"choices":[],"usage":{"completion_tokens":2},"epd_timings":{"prefill":0.5}}\n\n'
        yield b"data: [DONE]\n\n"

    def released(self) -> list[str]:
        return sorted(
            i for _, p, b in self.calls if p == "/v1/encode/release" for i in b["lease_ids"]
        )

    def llm_bodies(self) -> list[dict]:
        return [b for _, p, b in self.calls if p == "/v1/chat/completions"]



class FakePD(FakeNodes):
    """Adds prefill nodes (host p*) and decode nodes (host d*) to FakeNodes."""

    def __init__(self) -> None:
        super().__init__()
        self.prefill_status, self.prefill_body = 200, None
        self.decode_status, self.decode_body = 200, None
        self.leases = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host.startswith(("p", "d")) and request.url.path != "/health":
            base = f"{request.url.scheme}://{host}:{request.url.port}"
            body = json.loads(request.content) if request.content else {}
            self.calls.append((base, request.url.path, body))
            if base in self.down:
                raise httpx.ConnectError("connection refused", request=request)
            return self._prefill(base, body) if host.startswith("p") else self._decode(body)
        return await super().__call__(request)

    def _prefill(self, base: str, body: dict) -> httpx.Response:
        if body.get("lease_ids") is not None:
            return httpx.Response(200, json={"released": len(body["lease_ids"])})
        assert body["prefill_only"] is True and body["stream"] is False
        if self.prefill_status != 200:
            return httpx.Response(self.prefill_status, json=self.prefill_body)
        self.leases += 1
        migration = {"lease_id": f"{base}|L{self.leases}", "first_token": 7}
        return httpx.Response(200, json={"id": "p", "migration_request": migration})

    def _decode(self, body: dict) -> httpx.Response:
        assert "migration_request" in body and "prefill_only" not in body
        if self.decode_status != 200:
            return httpx.Response(self.decode_status, json=self.decode_body)
        if body.get("stream"):
            return httpx.Response(
                200, content=self._sse(), headers={"content-type": "text/event-stream"}
            )
        reply = {"choices": [{"message": {"content": "pd"}}], "epd_timings": {"pd_migration": 0.02}}
        return httpx.Response(200, json=reply)

    def bodies(self, base: str, path: str = "/v1/chat/completions") -> list[dict]:
        return [b for u, p, b in self.calls if u == base and p == path]

    def prefill_released(self) -> list[str]:
        return [i for u, p, b in self.calls if p == "/v1/prefill/release" for i in b["lease_ids"]]



async def always_healthy(node: Node) -> None:
    return None



def make_client(fake: FakeNodes, nodes=((ENC1, "encoder"), (ENC2, "encoder"), (LLM, "llm")), **kw):
    cfg = ProxyConfig(nodes=tuple(nodes), health_interval_s=60, **kw)
    app = create_app(cfg, transport=httpx.MockTransport(fake), health_fn=always_healthy)
    return TestClient(app)


def chat(*urls: str, stream: bool = False) -> dict:
    content = [image(u) for u in urls] + [{"type": "text", "text": "what?"}]
    return {"model": "m", "messages": [{"role": "user", "content": content}], "stream": stream}



def text_chat(stream: bool = False, **extra) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        **extra,
    }

