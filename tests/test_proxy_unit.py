"""Proxy unit tests: routing, registry health transitions, image splitting, error mapping,
and the whole app in-process against fake nodes (httpx.MockTransport)."""

from __future__ import annotations

import asyncio
import json

import pytest
from helpers.proxy_fakes import ENC1, ENC2, LLM, FakeNodes, chat, image, make_client

from epd.proxy.config import ProxyConfig
from epd.proxy.orchestrator import Encoded, collect_images, remap_param, split_evenly
from epd.proxy.registry import Node, NodeRegistry, RoleConflict
from epd.proxy.routing import LeastLoaded, RandomChoice, RoundRobin, make_router


def nodes(n: int, role: str = "llm") -> list[Node]:
    return [Node(url=f"http://n{i}:1", role=role) for i in range(n)]


# ------------------------------------------------------------------------------ routing


def test_round_robin_cycles_and_choose_many_is_distinct():
    rr, ns = RoundRobin(), nodes(3)
    assert [rr.choose(ns).url for _ in range(4)] == [ns[i].url for i in (0, 1, 2, 0)]
    many = rr.choose_many(ns, 2)
    assert [n.url for n in many] == [ns[1].url, ns[2].url]
    assert len({n.url for n in rr.choose_many(ns, 5)}) == 3
    assert rr.choose([]) is None and rr.choose_many([], 2) == []


def test_least_loaded_prefers_fewest_in_flight_and_rotates_ties():
    ll, ns = LeastLoaded(), nodes(3)
    ns[0].in_flight, ns[1].in_flight, ns[2].in_flight = 2, 0, 1
    assert ll.choose(ns) is ns[1]
    assert [n.url for n in ll.choose_many(ns, 2)] == [ns[1].url, ns[2].url]
    for n in ns:
        n.in_flight = 0
    assert {ll.choose(ns).url for _ in range(3)} == {n.url for n in ns}


def test_random_only_picks_given_nodes():
    rnd, ns = RandomChoice(seed=0), nodes(4)
    picked = {rnd.choose(ns).url for _ in range(50)}
    assert picked == {n.url for n in ns}
    many = rnd.choose_many(ns[:2], 3)
    assert sorted(n.url for n in many) == sorted(n.url for n in ns[:2])
    with pytest.raises(ValueError, match="unknown routing"):
        make_router("fastest")


# ----------------------------------------------------------------------------- registry


def test_registry_add_is_idempotent_and_roles_conflict():
    reg = NodeRegistry()
    node, created = reg.add("http://a:1/", "encoder")
    assert created and node.url == "http://a:1"
    assert reg.add("http://a:1", "encoder") == (node, False)
    with pytest.raises(RoleConflict):
        reg.add("http://a:1", "llm")
    with pytest.raises(ValueError):
        reg.add("ftp://b", "llm")
    with pytest.raises(ValueError):
        reg.add("http://b:1", "vision")
    assert reg.remove("http://a:1") and not reg.remove("http://a:1")


def test_health_transitions_fail_twice_out_success_back():
    up = {"ok": True}

    async def health(node: Node) -> None:
        if not up["ok"]:
            raise ConnectionError("refused")

    reg = NodeRegistry(failure_threshold=2, health_fn=health)
    node, _ = reg.add("http://a:1", "llm")

    async def scenario():
        up["ok"] = False
        await reg.check_all()
        assert node.healthy and node.consecutive_failures == 1
        await reg.check_all()
        assert not node.healthy and reg.healthy("llm") == []
        assert "refused" in node.last_error
        up["ok"] = True
        await reg.check_all()
        assert node.healthy and node.consecutive_failures == 0
        assert reg.counts()["llm"] == {"healthy": 1, "total": 1}

    asyncio.run(scenario())


def test_request_failures_count_and_track_restores_in_flight():
    reg = NodeRegistry(failure_threshold=2)
    node, _ = reg.add("http://a:1", "encoder")
    with reg.track(node), reg.track(node):
        assert node.in_flight == 2
    assert node.in_flight == 0
    reg.record_failure(node, "connect refused")
    assert node.healthy
    reg.record_failure(node, "connect refused")
    assert not node.healthy
    reg.record_success(node)
    assert node.healthy and node.consecutive_failures == 0


def test_config_validation():
    with pytest.raises(ValueError):
        ProxyConfig(routing="fastest")
    with pytest.raises(ValueError):
        ProxyConfig(mode="split")
    with pytest.raises(ValueError):
        ProxyConfig(nodes=(("http://a:1", "gpu"),))
    cfg = ProxyConfig(role_routing=(("encoder", "least_loaded"),))
    assert cfg.routing_for("encoder") == "least_loaded" and cfg.routing_for("llm") == "round_robin"
    assert ProxyConfig().host == "127.0.0.1"


# ------------------------------------------------------------------- splitting, mapping


def test_collect_images_in_order_with_params():
    body = {
        "messages": [
            {"role": "system", "content": "hi"},
            {"role": "user", "content": [image("a"), {"type": "text", "text": "x"}, image("b")]},
            {"role": "user", "content": [image("c")]},
        ]
    }
    slots = collect_images(body)
    assert [s.part["image_url"]["url"] for s in slots] == ["a", "b", "c"]
    assert [s.param for s in slots] == [
        "messages[1].content[0]",
        "messages[1].content[2]",
        "messages[2].content[0]",
    ]
    assert collect_images({"messages": "nope"}) == []


def test_split_evenly_keeps_order_and_balance():
    assert split_evenly(5, 2) == [range(0, 3), range(3, 5)]
    assert split_evenly(2, 4) == [range(0, 1), range(1, 2)]
    assert split_evenly(3, 1) == [range(0, 3)]
    for n in range(1, 8):
        for k in range(1, 5):
            chunks = split_evenly(n, k)
            assert [i for r in chunks for i in r] == list(range(n))
            assert max(map(len, chunks)) - min(map(len, chunks)) <= 1


def test_remap_param_and_attach():
    slots = collect_images({"messages": [{"role": "user", "content": [image("a"), image("b")]}]})
    err = {"error": {"message": "bad", "type": "invalid_request_error", "param": "content[1]"}}
    assert remap_param(err, slots)["error"]["param"] == "messages[0].content[1]"
    err["error"]["param"] = "content[0].image_url"
    assert remap_param(err, slots)["error"]["param"] == "messages[0].content[0].image_url"
    one, two = {"images": [1]}, {"images": [2]}
    assert Encoded([one]).attach_to({"a": 1}) == {"a": 1, "encoder_result": one}
    assert Encoded([one, two]).attach_to({})["encoder_result"] == [one, two]


# ------------------------------------------------------- the app against fake nodes


@pytest.fixture
def fake():
    return FakeNodes()



def test_text_request_goes_straight_to_llm(fake):
    with make_client(fake) as c:
        r = c.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
    assert [p for _, p, _ in fake.calls] == ["/v1/chat/completions"]
    assert "encoder_result" not in fake.llm_bodies()[0]


def test_images_split_across_encoders_in_order(fake):
    with make_client(fake) as c:
        assert c.post("/v1/chat/completions", json=chat("a", "b", "c")).status_code == 200
        assert c.post("/v1/chat/completions", json=chat("d")).status_code == 200
        metrics = c.get("/metrics").text
    encodes = [
        (base, [p["image_url"]["url"] for p in b["content"]])
        for base, p, b in fake.calls
        if p == "/v1/encode"
    ]
    assert sorted(encodes[:2]) == [(ENC1, ["a", "b"]), (ENC2, ["c"])]
    first, second = fake.llm_bodies()
    assert [i["mm_hash"] for r in first["encoder_result"] for i in r["images"]] == ["a", "b", "c"]
    assert isinstance(second["encoder_result"], dict)  # one encoder: the plain object
    assert fake.released() == []
    assert 'epd_proxy_requests_total{path="image"} 2.0' in metrics
    assert 'epd_proxy_migrate_seconds_count{kind="epd"} 2.0' in metrics
    assert 'epd_proxy_nodes_healthy{role="encoder"} 2.0' in metrics


def test_no_healthy_node_is_503_naming_the_role(fake):
    with make_client(fake, nodes=((LLM, "llm"),)) as c:
        r = c.post("/v1/chat/completions", json=chat("a"))
        assert r.status_code == 503 and "'encoder'" in r.json()["error"]["message"]
    with make_client(fake, nodes=((ENC1, "encoder"),)) as c:
        r = c.post("/v1/chat/completions", json=chat("a"))
        assert r.status_code == 503 and "'llm'" in r.json()["error"]["message"]
    with make_client(fake, mode="pd") as c:
        r = c.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 503 and "'prefill'" in r.json()["error"]["message"]


def test_bad_bodies_are_400(fake):
    with make_client(fake) as c:
        r = c.post(
            "/v1/chat/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = c.post("/v1/chat/completions", json={**chat("a"), "encoder_result": {"x": 1}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "encoder_result"
    assert fake.calls == []


def test_encoder_4xx_passes_through_with_client_param(fake):
    fake.encoder_error = (
        400,
        {
            "error": {
                "message": "bad image",
                "type": "invalid_request_error",
                "param": "content[0]",
                "code": None,
            }
        },
    )
    with make_client(fake, nodes=((ENC1, "encoder"), (LLM, "llm"))) as c:
        r = c.post("/v1/chat/completions", json=chat("a", "b"))
    assert r.status_code == 400
    assert r.json()["error"] == {
        **fake.encoder_error[1]["error"],
        "param": "messages[0].content[0]",
    }
    assert fake.llm_bodies() == []


def test_encoder_down_is_502_and_other_leases_released(fake):
    fake.down.add(ENC2)
    with make_client(fake) as c:
        r = c.post("/v1/chat/completions", json=chat("a", "b"))
        assert r.status_code == 502 and r.json()["error"]["code"] == "encode_failed"
        enc2 = next(n for n in c.get("/nodes").json()["nodes"] if n["url"] == ENC2)
    assert enc2["consecutive_failures"] == 1 and enc2["healthy"]
    assert fake.released() == [f"{ENC1}|a"] and fake.llm_bodies() == []


@pytest.mark.parametrize("status,expect", [(500, 502), (400, 400), (404, 404)])
def test_llm_errors_map_and_release_leases(fake, status, expect):
    fake.llm_status = status
    fake.llm_body = {
        "error": {
            "message": "boom",
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": None,
        }
    }
    with make_client(fake) as c:
        r = c.post("/v1/chat/completions", json=chat("a", "b"))
    assert r.status_code == expect
    if expect == 502:
        assert r.json()["error"]["code"] == "llm_failed" and "500" in r.json()["error"]["message"]
    else:
        assert r.json() == fake.llm_body  # unchanged
    assert fake.released() == [f"{ENC1}|a", f"{ENC2}|b"]


def test_stream_relayed_and_broken_stream_ends_with_error_chunk(fake):
    with make_client(fake) as c:
        r = c.post("/v1/chat/completions", json=chat("a", stream=True))
        events = [ln for ln in r.text.split("\n\n") if ln]
        assert events[-1] == "data: [DONE]" and len(events) == 4
        assert fake.released() == []
        fake.broken_stream = True
        r = c.post("/v1/chat/completions", json=chat("a", stream=True))
        events = [ln for ln in r.text.split("\n\n") if ln]
        metrics = c.get("/metrics").text
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2].removeprefix("data: "))["error"]
    assert err["code"] == "llm_failed" and "broken stream" in err["message"]
    assert len(fake.released()) == 1 and fake.released()[0].endswith("|a")
    assert "epd_proxy_time_to_first_token_seconds_count 1.0" in metrics
    assert 'epd_proxy_errors_total{kind="llm_failed"} 1.0' in metrics
    assert 'epd_proxy_engine_stage_seconds_count{stage="prefill"} 1.0' in metrics


def test_nodes_endpoints(fake):
    with make_client(fake, nodes=()) as c:
        r = c.post("/nodes/add", json={"url": "http://x:9/", "role": "llm"})
        assert r.json() == {"url": "http://x:9", "role": "llm", "created": True}
        assert (
            c.post("/nodes/add", json={"url": "http://x:9", "role": "llm"}).json()["created"]
            is False
        )
        r = c.post("/nodes/add", json={"url": "http://x:9", "role": "encoder"})
        assert r.status_code == 409 and r.json()["error"]["param"] == "role"
        assert c.post("/nodes/add", json={"url": "http://y:9", "role": "gpu"}).status_code == 400
        assert c.get("/health").json()["nodes"]["llm"] == {"healthy": 1, "total": 1}
        assert c.post("/nodes/remove", json={"url": "http://x:9"}).json()["removed"] is True
        assert c.get("/nodes").json() == {"nodes": []}
