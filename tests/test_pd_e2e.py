"""End to end, engine level: real `epd serve --role prefill` (local vision, a smaller KV
pool, a short lease) and `epd serve --role decode` processes; the test plays the proxy
with httpx / the openai client: the body with `prefill_only` to P, then the same body with
P's `migration_request` to D. D pulls the KV blocks over dlslime TCP and acks over ZMQ.

Every reply equals the reference oracle's greedy text; afterwards P's and D's free KV
blocks are back at their start values. A decode engine killed mid-stream (acks dropped)
ends the client's stream with an error, and P's blocks come back when the lease expires.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from helpers import EXAMPLE_IMAGES, ServerProcess

from epd.models.reference import reference_generate

pytestmark = pytest.mark.e2e

SERVED = "tiny"
MAX_TOKENS = 8
P_BLOCKS, D_BLOCKS = 24, 64
LEASE_S = 4


def wait_for(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def messages(image: str | None, text: str) -> list[dict]:
    if image is None:
        return [{"role": "user", "content": text}]
    part = {"type": "image_url", "image_url": {"url": str(EXAMPLE_IMAGES / image)}}
    return [{"role": "user", "content": [part, {"type": "text", "text": text}]}]


_REFS: dict = {}


def reference(model_dir: Path, image: str | None, text: str) -> str:
    key = (image, text)
    if key not in _REFS:
        _REFS[key] = reference_generate(model_dir, messages(image, text), MAX_TOKENS).text
    return _REFS[key]


def serve(role: str, model_dir: Path, log_dir: Path, *extra, env=None) -> ServerProcess:
    args = ["serve", "--role", role, "--model", model_dir, "--served-model-name", SERVED,
            "--block-size", 8, "--max-model-len", 512, "--transfer", "tcp", *extra]
    return ServerProcess(args, log_dir=log_dir, name=role, env=env).start()


@pytest.fixture(scope="module")
def pd(llava_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("pd-e2e")
    p = serve("prefill", llava_dir, log_dir, "--num-blocks", P_BLOCKS, "--vision", "local",
              "--lease-seconds", LEASE_S, "--allowed-local-media-path", EXAMPLE_IMAGES)
    try:
        d = serve("decode", llava_dir, log_dir, "--num-blocks", D_BLOCKS)
        try:
            yield p, d
        finally:
            d.stop()
    finally:
        p.stop()


def stats(srv: ServerProcess) -> dict:
    return httpx.get(f"{srv.url}/health", timeout=10).json()["stats"]


def assert_released(p: ServerProcess, d: ServerProcess) -> None:
    assert wait_for(lambda: stats(p)["kv_blocks_free"] == P_BLOCKS)
    assert wait_for(lambda: stats(d)["kv_blocks_free"] == D_BLOCKS)
    assert stats(p)["pd_leases_active"] == 0 and stats(d)["pd_num_migrating"] == 0


def prefill(p: ServerProcess, body: dict) -> dict:
    r = httpx.post(f"{p.url}/v1/chat/completions", timeout=60,
                   json={**body, "prefill_only": True, "stream": False})
    assert r.status_code == 200, r.text
    return r.json()


def body_for(image: str | None, text: str, **kw) -> dict:
    return {"model": SERVED, "messages": messages(image, text), "max_tokens": MAX_TOKENS,
            "temperature": 0, **kw}


@pytest.mark.parametrize("image", [None, "cat.png"], ids=["text", "image"])
def test_pd_chat_matches_reference(pd, llava_dir, image):
    p, d = pd
    text = "What do you see?"
    want = reference(llava_dir, image, text)
    body = body_for(image, text)
    pre = prefill(p, body)
    mr = pre["migration_request"]
    assert pre["usage"]["completion_tokens"] == 1 and len(mr["block_ids"]) <= P_BLOCKS
    assert stats(p)["pd_leases_active"] >= 1
    r = httpx.post(f"{d.url}/v1/chat/completions", json={**body, "migration_request": mr},
                   timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["message"]["content"] == want
    assert out["usage"]["prompt_tokens"] == mr["num_tokens"] == pre["usage"]["prompt_tokens"]
    assert out["epd_timings"]["pd_migration"] > 0
    # streamed, with the openai client
    mr = prefill(p, body)["migration_request"]
    client = openai.OpenAI(base_url=f"{d.url}/v1", api_key="x", max_retries=0)
    chunks = list(client.chat.completions.create(
        model=SERVED, messages=body["messages"], max_tokens=MAX_TOKENS, temperature=0,
        stream=True, stream_options={"include_usage": True},
        extra_body={"migration_request": mr}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.prompt_tokens == mr["num_tokens"]
    assert_released(p, d)


def test_pd_concurrent_text(pd, llava_dir):
    """8 at once, half through /v1/chat/completions, half through /v1/completions (the
    same prompt as token ids)."""
    from epd.models import MultimodalProcessor

    p, d = pd
    proc = MultimodalProcessor.from_pretrained(llava_dir)
    texts = [f"Count the boats, part {i}." for i in range(8)]

    def one(i: int) -> str:
        body, path = body_for(None, texts[i]), "/v1/chat/completions"
        if i % 2:
            ids = list(proc.tokenize(proc.render(body.pop("messages")), []).token_ids)
            body, path = {**body, "prompt": ids}, "/v1/completions"
        r = httpx.post(f"{p.url}{path}", json={**body, "prefill_only": True}, timeout=60)
        assert r.status_code == 200, r.text
        mr = r.json()["migration_request"]
        r = httpx.post(f"{d.url}{path}", json={**body, "migration_request": mr}, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["text"] if i % 2 else choice["message"]["content"]

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, range(8)))
    for i, text in enumerate(got):
        assert text == reference(llava_dir, None, texts[i]), i
    metrics = httpx.get(f"{d.url}/metrics", timeout=10).text
    assert "epd_pd_migrations_total" in metrics and "epd_pd_migration_seconds_bucket" in metrics
    assert "epd_pd_leases_active" in httpx.get(f"{p.url}/metrics", timeout=10).text
    assert_released(p, d)


def test_pd_bad_requests(pd):
    p, d = pd
    body = body_for(None, "hello")
    cases = [
        (p, body, 400, "prefill_only"),
        (p, {**body, "prefill_only": True, "n": 2}, 400, "n"),
        (d, body, 400, "migration_request"),
    ]
    mr = prefill(p, body)["migration_request"]
    bad_layout = {**mr, "kv_layout": {**mr["kv_layout"], "num_kv_heads": 99}}
    cases += [
        (d, {**body, "migration_request": bad_layout}, 400, "migration_request.kv_layout"),
        (d, {**body, "migration_request": {**mr, "block_ids": [0]}}, 400,
         "migration_request.block_ids"),
        (d, {**body_for(None, "other"), "migration_request": mr}, 400,
         "migration_request.num_tokens"),
    ]
    for srv, b, status, param in cases:
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=b, timeout=30)
        assert r.status_code == status, (param, r.text)
        assert r.json()["error"]["param"] == param
    # the proxy's release when D fails before migrating; idempotent
    for released in (1, 0):
        r = httpx.post(f"{p.url}/v1/prefill/release", json={"lease_ids": [mr["lease_id"]]})
        assert r.status_code == 200 and r.json()["released"] == released
    assert_released(p, d)


def test_decode_killed_mid_stream(pd, llava_dir, tmp_path):
    p, d = pd
    victim = serve("decode", llava_dir, tmp_path, "--num-blocks", D_BLOCKS,
                   env={"EPD_TEST_DROP_ACKS": "1"})  # only lease expiry frees P's blocks
    try:
        body = body_for(None, "Tell me a long story.", max_tokens=400, ignore_eos=True,
                        stream=True)
        mr = prefill(p, body)["migration_request"]
        t_leased = time.monotonic()
        ended_with_error, saw_done = False, False
        try:
            with httpx.stream("POST", f"{victim.url}/v1/chat/completions", timeout=60,
                              json={**body, "migration_request": mr}) as r:
                assert r.status_code == 200
                n = 0
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        n += 1
                        assert "error" not in json.loads(line[6:])
                        if n == 3:
                            os.killpg(victim.proc.pid, signal.SIGKILL)
                    saw_done |= line == "data: [DONE]"
        except httpx.HTTPError:
            ended_with_error = True
        assert ended_with_error and not saw_done
        assert stats(p)["kv_blocks_free"] < P_BLOCKS  # no ack came
        assert wait_for(lambda: stats(p)["kv_blocks_free"] == P_BLOCKS, LEASE_S + 10)
        assert time.monotonic() - t_leased >= LEASE_S - 0.5
        assert stats(p)["pd_leases_expired"] >= 1
    finally:
        victim.stop()
    assert_released(p, d)
