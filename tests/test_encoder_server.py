"""End to end: a real `epd serve --role encoder` process; this test is the consumer.

It encodes example images over HTTP, pulls the feature blocks through the transfer layer
(handshake at the encoder's /v1/transfer/connect, dlslime TCP read of the block ids),
compares them with the reference model's image features, and releases them by ZMQ ack,
by HTTP release, or lets them expire.
"""

from __future__ import annotations

import base64
import concurrent.futures
import http.server
import json
import struct
import threading
import time
import zlib
from pathlib import Path

import httpx
import pytest
import torch
from helpers import EXAMPLE_IMAGES, ServerProcess, free_port
from PIL import Image

from epd.models.reference import reference_image_features
from epd.protocol import EncoderResult
from epd.transfer import create_transfer_engine, merge_block_ops
from epd.transfer.acks import AckSender
from epd.transfer.http import http_handshake
from epd.transfer.messages import Ack

pytestmark = pytest.mark.e2e

LEASE_S = 4.0
LIMIT = 4


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def huge_png_header() -> bytes:
    """A PNG whose IHDR claims 30000x30000 pixels, with a tiny IDAT: cheap to make."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        crc = zlib.crc32(kind + payload) & 0xFFFFFFFF
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


class FakeProxy(http.server.BaseHTTPRequestHandler):
    """Refuses the first registration (503), accepts the next: the encoder must retry."""

    bodies: list[bytes] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        FakeProxy.bodies.append(body)
        self.send_response(503 if len(FakeProxy.bodies) == 1 else 200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def proxy_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), FakeProxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def encoder_srv(llava_dir, proxy_url, tmp_path_factory):
    args = [
        "serve", "--role", "encoder", "--model", str(llava_dir),
        "--mm-block-tokens", "4", "--mm-num-blocks", "64", "--lease-seconds", str(LEASE_S),
        "--allowed-local-media-path", str(EXAMPLE_IMAGES), "--limit-images-per-request", str(LIMIT),
        "--batch-window-ms", "20", "--transfer", "tcp", "--proxy-url", proxy_url,
    ]  # fmt: skip
    with ServerProcess(args, log_dir=tmp_path_factory.mktemp("encoder")) as srv:
        yield srv


@pytest.fixture(scope="module")
def encoder(encoder_srv):
    with httpx.Client(base_url=encoder_srv.url, timeout=60.0) as client:
        yield client


@pytest.fixture(scope="module")
def not_found_url():
    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/missing.png"
    server.shutdown()
    server.server_close()


def stats(client: httpx.Client) -> dict:
    resp = client.get("/v1/encode/stats")
    assert resp.status_code == 200
    return resp.json()


def encode(client: httpx.Client, *urls: str) -> EncoderResult:
    content = [{"type": "text", "text": "ignored"}, *(image_part(u) for u in urls)]
    resp = client.post("/v1/encode", json={"content": content})
    assert resp.status_code == 200, resp.text
    return EncoderResult.model_validate(resp.json()["encoder_result"])


def release(client: httpx.Client, result: EncoderResult) -> None:
    resp = client.post("/v1/encode/release", json={"lease_ids": result.lease_ids})
    assert resp.status_code == 200, resp.text


def wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_encode_transfer_matches_reference_and_ack_releases(encoder, llava_dir):
    pil = [Image.open(EXAMPLE_IMAGES / n).convert("RGB") for n in ("sunset.png", "cat.png")]
    expected = reference_image_features(llava_dir, pil)  # before encoding: leases are short
    raw = (EXAMPLE_IMAGES / "sunset.png").read_bytes()
    before = stats(encoder)
    result = encode(encoder, data_url(raw), str(EXAMPLE_IMAGES / "cat.png"))
    assert result.transfer_backend == "tcp" and result.ack_address.startswith("tcp://127.0.0.1:")
    assert len(result.images) == 2
    after = stats(encoder)
    assert after["leases"] == before["leases"] + 2

    img0 = result.images[0]
    total_blocks = sum(len(img.block_ids) for img in result.images)
    dst = torch.full((total_blocks + 1, img0.block_tokens, img0.hidden_size), float("nan"))
    engine = create_transfer_engine(result.transfer_backend, "127.0.0.1")
    try:
        engine.register_pool("dst", dst)
        engine.connect(result.encoder_id, http_handshake(result.encoder_url, engine.engine_id))
        block_nbytes = img0.block_tokens * img0.hidden_size * dst.element_size()
        next_block = 1  # leave block 0 untouched: the read must land exactly where asked
        for img, want in zip(result.images, expected, strict=True):
            local = list(range(next_block, next_block + len(img.block_ids)))
            next_block += len(local)
            ops = merge_block_ops(local, img.block_ids, block_nbytes)
            future = engine.read(result.encoder_id, "dst", result.pool_name, ops)
            assert future.wait(30.0) and future.error is None
            got = dst[local].reshape(-1, img.hidden_size)[: img.num_tokens]
            assert img.num_tokens == want.shape[0]
            torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-4)
        assert torch.isnan(dst[0]).all()
    finally:
        engine.close()

    sender = AckSender()
    try:
        sender.send(
            result.ack_address, Ack(kind="release", lease_ids=result.lease_ids, consumer_id="test")
        )
    finally:
        sender.close()
    assert wait_until(lambda: stats(encoder)["leases"] == before["leases"])
    final = stats(encoder)
    assert final["leases_released"] == before["leases_released"] + 2
    assert final["blocks_referenced"] == before["blocks_referenced"]
    # A late HTTP release of the same leases is a no-op.
    resp = encoder.post("/v1/encode/release", json={"lease_ids": result.lease_ids})
    assert resp.json() == {"released": 0}


def test_lost_ack_is_freed_by_lease_expiry(encoder):
    before = stats(encoder)
    result = encode(encoder, str(EXAMPLE_IMAGES / "bar_chart.jpg"))
    assert result.images[0].lease_expires_at > time.time()
    assert stats(encoder)["leases"] == before["leases"] + 1
    assert wait_until(lambda: stats(encoder)["leases"] == before["leases"], LEASE_S + 5)
    after = stats(encoder)
    assert after["leases_expired"] == before["leases_expired"] + 1
    assert after["blocks_referenced"] == before["blocks_referenced"]


def test_same_image_twice_is_encoded_once(encoder):
    url = str(EXAMPLE_IMAGES / "city_street.jpg")
    before = stats(encoder)
    first = encode(encoder, url)
    second = encode(encoder, url)
    assert first.images[0].block_ids == second.images[0].block_ids
    assert first.images[0].mm_hash == second.images[0].mm_hash
    after = stats(encoder)
    assert after["encodes"] == before["encodes"] + 1
    assert after["hits"] == before["hits"] + 1
    release(encoder, first)
    release(encoder, second)


def test_concurrent_requests_for_one_new_image_encode_once(encoder):
    url = data_url((EXAMPLE_IMAGES / "spiral.webp").read_bytes(), "image/webp")
    before = stats(encoder)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: encode(encoder, url), range(8)))
    assert len({tuple(r.images[0].block_ids) for r in results}) == 1
    after = stats(encoder)
    assert after["encodes"] == before["encodes"] + 1
    assert after["hits"] == before["hits"] + 7
    for r in results:
        release(encoder, r)
    assert stats(encoder)["leases"] == before["leases"]


def bad_inputs(not_found_url: str) -> list[tuple[str, dict]]:
    png = (EXAMPLE_IMAGES / "sunset.png").read_bytes()
    outside = Path(__file__).resolve()
    return [
        ("bad base64", image_part("data:image/png;base64,@@not*base64@@")),
        ("not an image", image_part(data_url(b"hello, I am plain text, not pixels"))),
        ("truncated png", image_part(data_url(png[: len(png) // 2]))),
        ("30000x30000 png", image_part(data_url(huge_png_header()))),
        ("outside the allowed dir", image_part(str(outside))),
        ("../ traversal", image_part(f"{EXAMPLE_IMAGES}/../../pyproject.toml")),
        ("http 404", image_part(not_found_url)),
        ("unsupported scheme", image_part("ftp://example.com/a.png")),
    ]


def test_bad_inputs_get_4xx_naming_the_part_and_nothing_leaks(encoder, not_found_url):
    baseline = stats(encoder)
    good = image_part(str(EXAMPLE_IMAGES / "cat.png"))
    for label, bad in bad_inputs(not_found_url):
        content = [{"type": "text", "text": "x"}, good, bad]
        resp = encoder.post("/v1/encode", json={"content": content})
        assert 400 <= resp.status_code < 500, (label, resp.status_code, resp.text)
        error = resp.json()["error"]
        assert error["param"] == "content[2]", (label, error)
        assert error["message"] and error["type"] == "invalid_request_error", (label, error)

    too_many = [image_part(str(EXAMPLE_IMAGES / "cat.png"))] * (LIMIT + 1)
    for content, param in (
        (too_many, "content"),
        ([{"type": "text", "text": "no images"}], "content"),
        ([], "content"),
    ):
        resp = encoder.post("/v1/encode", json={"content": content})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    resp = encoder.post(
        "/v1/encode", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert resp.status_code == 400 and "error" in resp.json()

    after = stats(encoder)
    assert after["leases"] == baseline["leases"]
    assert after["blocks_referenced"] == baseline["blocks_referenced"]
    # Still serving: a good request works, and its release brings the pool back.
    result = encode(encoder, str(EXAMPLE_IMAGES / "cat.png"))
    release(encoder, result)
    final = stats(encoder)
    assert final["leases"] == baseline["leases"]
    assert final["blocks_referenced"] == baseline["blocks_referenced"]
    assert final["blocks_used"] + final["blocks_free"] == final["blocks_total"]


def test_registers_with_the_proxy_retrying(encoder_srv):
    assert wait_until(lambda: len(FakeProxy.bodies) >= 2, 10.0)
    assert [json.loads(b) for b in FakeProxy.bodies[:2]] == [
        {"url": encoder_srv.url, "role": "encoder"}
    ] * 2


def test_health_and_metrics(encoder):
    health = encoder.get("/health").json()
    assert health["status"] == "ok" and health["role"] == "encoder"
    assert health["pool"]["blocks_total"] == 64
    text = encoder.get("/metrics").text
    for name in (
        "epd_encoder_images_encoded_total",
        "epd_encoder_cache_hits_total",
        "epd_encoder_cache_misses_total",
        "epd_encoder_mm_blocks_used",
        "epd_encoder_mm_blocks_free",
        "epd_encoder_encode_latency_seconds_bucket",
        "epd_encoder_batch_size_bucket",
        "epd_encoder_leases_active",
        "epd_encoder_leases_expired_total",
    ):
        assert name in text, name
