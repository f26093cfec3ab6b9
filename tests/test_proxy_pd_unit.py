"""Proxy unit tests for PD mode ([E ->] P -> D): routing by mode, the P and D bodies,
error mapping and lease release on every failure path, against in-process fakes."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi.testclient import TestClient
from helpers.proxy_fakes import (
    D1,
    D2,
    ENC1,
    LLM,
    P1,
    PD_NODES,
    FakePD,
    chat,
    make_client,
    text_chat,
)

from epd.proxy.config import ProxyConfig
from epd.proxy.registry import Node
from epd.proxy.server import create_app


@pytest.fixture
def fpd():
    return FakePD()



def test_pd_text_goes_prefill_then_decode(fpd):
    body = text_chat(stream=False, max_tokens=5)
    with make_client(fpd, nodes=PD_NODES) as c:
        r = c.post("/v1/chat/completions", json=body)
        metrics = c.get("/metrics").text
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "pd"
    assert [(u, p) for u, p, _ in fpd.calls] == [
        (P1, "/v1/chat/completions"),
        (D1, "/v1/chat/completions"),
    ]
    (pbody,) = fpd.bodies(P1)
    assert pbody == {**body, "prefill_only": True, "stream": False}
    (dbody,) = fpd.bodies(D1)
    assert dbody == {**body, "migration_request": {"lease_id": f"{P1}|L1", "first_token": 7}}
    assert fpd.prefill_released() == []
    assert 'epd_proxy_requests_total{path="pd"} 1.0' in metrics
    assert "epd_proxy_prefill_seconds_count 1.0" in metrics
    assert 'epd_proxy_migrate_seconds_count{kind="pd"} 1.0' in metrics


def test_pd_image_goes_encoder_prefill_decode_stream(fpd):
    body = {**chat("a", stream=True), "stream_options": {"include_usage": True}}
    with make_client(fpd, nodes=PD_NODES) as c:
        r = c.post("/v1/chat/completions", json=body)
        metrics = c.get("/metrics").text
    events = [ln for ln in r.text.split("\n\n") if ln]
    assert events[-1] == "data: [DONE]" and len(events) == 4 and "lease_id" not in r.text
    assert [p for _, p, _ in fpd.calls] == ["/v1/encode"] + ["/v1/chat/completions"] * 2
    (pbody,) = fpd.bodies(P1)
    assert pbody["encoder_result"]["images"][0]["mm_hash"] == "a"
    assert "stream_options" not in pbody and pbody["stream"] is False
    (dbody,) = fpd.bodies(D1)
    assert "encoder_result" not in dbody and dbody["stream_options"] == body["stream_options"]
    assert dbody["stream"] is True and dbody["messages"] == body["messages"]
    assert fpd.released() == [] and fpd.prefill_released() == []
    assert 'epd_proxy_requests_total{path="epd_pd"} 1.0' in metrics


def test_pd_refuses_n_above_one(fpd):
    with make_client(fpd, nodes=PD_NODES) as c:
        r = c.post("/v1/chat/completions", json=text_chat(n=2))
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        assert c.post("/v1/chat/completions", json=text_chat(n=1)).status_code == 200
    assert len(fpd.calls) == 2


@pytest.mark.parametrize(
    "mode,nodes,expect",
    [
        ("auto", ((LLM, "llm"), (P1, "prefill"), (D1, "decode")), [LLM]),
        ("pd", ((LLM, "llm"), (P1, "prefill"), (D1, "decode")), [P1, D1]),
        ("auto", ((P1, "prefill"), (D1, "decode")), [P1, D1]),
        ("colocated", ((LLM, "llm"), (P1, "prefill"), (D1, "decode")), [LLM]),
    ],
)
def test_mode_picks_the_path(fpd, mode, nodes, expect):
    with make_client(fpd, nodes=nodes, mode=mode) as c:
        assert c.post("/v1/chat/completions", json=text_chat()).status_code == 200
    assert [u for u, _, _ in fpd.calls] == expect


def test_pd_missing_roles_are_503(fpd):
    with make_client(fpd, nodes=((P1, "prefill"),)) as c:
        r = c.post("/v1/chat/completions", json=text_chat())
        assert r.status_code == 503 and "'decode'" in r.json()["error"]["message"]
    with make_client(fpd, nodes=((P1, "prefill"), (D1, "decode"))) as c:
        r = c.post("/v1/chat/completions", json=chat("a"))
        assert r.status_code == 503 and "'encoder'" in r.json()["error"]["message"]
    with make_client(fpd, nodes=((P1, "prefill"), (D1, "decode")), mode="colocated") as c:
        r = c.post("/v1/chat/completions", json=text_chat())
        assert r.status_code == 503 and "'llm'" in r.json()["error"]["message"]
    assert fpd.calls == []


@pytest.mark.parametrize(
    "failure,status,code",
    [
        ("down", 502, "prefill_failed"),
        (500, 502, "prefill_failed"),
        (400, 400, None),
        (503, 503, "service_unavailable"),
        ("malformed", 502, "prefill_failed"),
    ],
)
def test_prefill_failure_releases_encoder_leases(fpd, failure, status, code):
    err = {"error": {"message": "no", "type": "x", "param": None, "code": code}}
    if failure == "down":
        fpd.down.add(P1)
    elif failure == "malformed":
        fpd.prefill_status, fpd.prefill_body = 200, None
        fpd._prefill = lambda base, body: httpx.Response(200, json={"id": "p"})
    else:
        fpd.prefill_status, fpd.prefill_body = failure, err
    with make_client(fpd, nodes=PD_NODES) as c:
        r = c.post("/v1/chat/completions", json=chat("a", "b"))
    assert r.status_code == status and r.json()["error"]["code"] == code
    if status == 502:
        assert "prefill stage failed" in r.json()["error"]["message"]
    else:
        assert r.json() == err  # P's own answer, unchanged
    assert fpd.released() == [f"{ENC1}|a", f"{ENC1}|b"]
    assert fpd.bodies(D1) == [] and fpd.prefill_released() == []


@pytest.mark.parametrize(
    "failure,status,code",
    [("down", 502, "decode_failed"), (500, 502, "decode_failed"), (400, 400, None)],
)
@pytest.mark.parametrize("stream", [False, True])
def test_decode_failure_releases_the_prefill_lease(fpd, failure, status, code, stream):
    err = {"error": {"message": "no", "type": "x", "param": "max_tokens", "code": None}}
    if failure == "down":
        fpd.down.add(D1)
    else:
        fpd.decode_status, fpd.decode_body = failure, err
    with make_client(fpd, nodes=PD_NODES) as c:
        r = c.post("/v1/chat/completions", json=text_chat(stream=stream))
    assert r.status_code == status and r.json()["error"]["code"] == code
    if status == 502:
        assert "decode stage failed" in r.json()["error"]["message"]
    else:
        assert r.json() == err
    assert fpd.prefill_released() == [f"{P1}|L1"]


def test_decode_dies_mid_stream_then_traffic_moves_to_other_decode(fpd):
    async def health(node: Node) -> None:
        if node.url in fpd.down:
            raise ConnectionError("refused")

    cfg = ProxyConfig(nodes=((P1, "prefill"), (D1, "decode"), (D2, "decode")), health_interval_s=60)
    app = create_app(cfg, transport=httpx.MockTransport(fpd), health_fn=health)
    fpd.broken_stream = True
    with TestClient(app) as c:
        r = c.post("/v1/chat/completions", json=text_chat(stream=True))
        events = [ln for ln in r.text.split("\n\n") if ln]
        assert events[-1] == "data: [DONE]"
        err = json.loads(events[-2].removeprefix("data: "))["error"]
        assert err["code"] == "decode_failed" and "broken stream" in err["message"]
        assert fpd.prefill_released() == [f"{P1}|L1"]
        fpd.down.add(D1)  # the killed decode node stops answering health checks
        c.portal.call(c.app.state.proxy.registry.check_all)
        d1 = next(n for n in c.get("/nodes").json()["nodes"] if n["url"] == D1)
        assert not d1["healthy"] and d1["consecutive_failures"] == 2
        fpd.broken_stream = False
        for _ in range(2):
            assert c.post("/v1/chat/completions", json=text_chat()).status_code == 200
    assert [u for u, p, _ in fpd.calls if u in (D1, D2)] == [D1, D2, D2]
