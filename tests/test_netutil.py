"""epd.netutil: byte sizes, wildcard hosts, public URLs, registration with the proxy."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from epd import netutil
from epd.netutil import advertised_host, is_wildcard_host, parse_bytes, public_url


@pytest.mark.parametrize(
    "text,expect",
    [("4096", 4096), (4096, 4096), ("64MiB", 64 * 2**20), ("2GiB", 2 * 2**30),
     ("1.5 KiB", 1536), ("500MB", 500 * 10**6), ("1g", 10**9), ("3Ti", 3 * 2**40),
     (" 7b ", 7)],
)
def test_parse_bytes(text, expect):
    assert parse_bytes(text) == expect


@pytest.mark.parametrize("text", ["", "MiB", "12 parsecs", "-5", "1..2GiB"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError, match="not a byte size"):
        parse_bytes(text)


def test_wildcard_hosts_and_public_url():
    assert all(is_wildcard_host(h) for h in ("0.0.0.0", "::", ""))
    assert not is_wildcard_host("127.0.0.1") and not is_wildcard_host("localhost")
    assert advertised_host("127.0.0.1") == "127.0.0.1"
    assert not is_wildcard_host(advertised_host("0.0.0.0"))
    assert public_url("127.0.0.1", 8000) == "http://127.0.0.1:8000"
    assert public_url("::1", 9) == "http://[::1]:9"


def _mock_client(monkeypatch, handler):
    real = httpx.AsyncClient
    monkeypatch.setattr(
        netutil.httpx, "AsyncClient",
        lambda **kw: real(transport=httpx.MockTransport(handler), **kw),
    )


def test_register_with_proxy_retries_until_accepted(monkeypatch):
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((str(request.url), json.loads(request.content)))
        return httpx.Response(503 if len(seen) == 1 else 200, json={})

    _mock_client(monkeypatch, handler)
    ok = asyncio.run(netutil.register_with_proxy("http://proxy:1/", "http://me:2", "decode"))
    assert ok is True and len(seen) == 2
    assert seen[0] == ("http://proxy:1/nodes/add", {"url": "http://me:2", "role": "decode"})


def test_register_with_proxy_gives_up_after_attempts(monkeypatch):
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        raise httpx.ConnectError("refused", request=request)

    _mock_client(monkeypatch, handler)
    assert asyncio.run(netutil.register_with_proxy("http://p:1", "http://me:2", "llm",
                                                   attempts=1)) is False
    assert len(calls) == 1
