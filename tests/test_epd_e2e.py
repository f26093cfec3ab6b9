"""End to end: real `epd serve --role encoder` and `epd serve --role llm` processes (no
local vision on the LLM). The test plays the proxy: it encodes over HTTP, then sends the
chat request with `encoder_result` to the LLM (httpx and the openai client, streaming and
not). The LLM pulls the features over dlslime TCP, acks the leases over ZMQ, and answers
with the reference model's text. Failures: a bad encoder_result is a 400 naming the field,
a dead encoder a 502 naming epd_migration; a lost ack is covered by lease expiry.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest
from helpers import EXAMPLE_IMAGES, ServerProcess

from epd.models.reference import reference_generate

pytestmark = pytest.mark.e2e

SERVED = "tiny-llava"
MAX_TOKENS = 8
NUM_BLOCKS = 64
MM_BLOCKS = 48


def image_part(name: str) -> dict:
    return {"type": "image_url", "image_url": {"url": str(EXAMPLE_IMAGES / name)}}


def messages_for(names: list[str], text: str) -> list[dict]:
    return [{"role": "user", "content": [*(image_part(n) for n in names),
                                         {"type": "text", "text": text}]}]


def wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def encoder_args(model: Path, lease_s: float) -> list:
    return ["serve", "--role", "encoder", "--model", model, "--mm-block-tokens", 4,
            "--mm-num-blocks", 64, "--lease-seconds", lease_s, "--transfer", "tcp",
            "--allowed-local-media-path", EXAMPLE_IMAGES, "--batch-window-ms", 1]


def llm_args(model: Path, timeout_s: float = 30.0) -> list:
    # No --allowed-local-media-path: the LLM must never load the image parts itself.
    return ["serve", "--role", "llm", "--model", model, "--served-model-name", SERVED,
            "--num-blocks", NUM_BLOCKS, "--max-model-len", 256, "--transfer", "tcp",
            "--mm-block-tokens", 3, "--mm-num-blocks", MM_BLOCKS,
            "--migration-timeout", timeout_s]


@pytest.fixture(scope="module")
def encoder(llava_dir, tmp_path_factory):
    with ServerProcess(encoder_args(llava_dir, 30), log_dir=tmp_path_factory.mktemp("enc")) as s:
        yield s


@pytest.fixture(scope="module")
def llm(llava_dir, tmp_path_factory):
    with ServerProcess(llm_args(llava_dir), log_dir=tmp_path_factory.mktemp("llm")) as s:
        yield s


def encode(encoder: ServerProcess, names: list[str]) -> dict:
    r = httpx.post(f"{encoder.url}/v1/encode", timeout=60,
                   json={"content": [image_part(n) for n in names]})
    assert r.status_code == 200, r.text
    return r.json()["encoder_result"]


def enc_stats(encoder: ServerProcess) -> dict:
    return httpx.get(f"{encoder.url}/v1/encode/stats", timeout=10).json()


def llm_stats(llm: ServerProcess) -> dict:
    return httpx.get(f"{llm.url}/health", timeout=10).json()["stats"]


def assert_released(encoder: ServerProcess, llm: ServerProcess, leases_before: int) -> None:
    assert wait_until(lambda: enc_stats(encoder)["leases"] == leases_before)
    assert enc_stats(encoder)["blocks_referenced"] == 0
    assert wait_until(lambda: llm_stats(llm)["kv_blocks_free"] == NUM_BLOCKS)
    s = llm_stats(llm)
    assert s["mm_blocks_referenced"] == 0 and s["mm_blocks_free"] == MM_BLOCKS
    assert s["num_migrating"] == s["num_running"] == s["num_waiting"] == 0


def chat_body(messages: list[dict], result: dict, **kw) -> dict:
    return {"model": SERVED, "messages": messages, "max_tokens": MAX_TOKENS,
            "temperature": 0, "encoder_result": result, **kw}


@pytest.mark.parametrize("names", [["cat.png"], ["bar_chart.jpg", "spiral.webp", "sunset.png"]])
def test_epd_chat_matches_reference(encoder, llm, llava_dir, names):
    messages = messages_for(names, "What do you see?")
    ref = reference_generate(llava_dir, messages, MAX_TOKENS)
    before = enc_stats(encoder)["leases"]
    # httpx, not streamed
    r = httpx.post(f"{llm.url}/v1/chat/completions", json=chat_body(messages, encode(encoder, names)),
                   timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == ref.text
    assert body["usage"]["completion_tokens"] == len(ref.token_ids)
    timings = body["epd_timings"]
    assert timings["epd_migration"] > 0 and timings["prefill"] > 0 and timings["total"] > 0
    assert_released(encoder, llm, before)
    # openai client, not streamed and streamed
    client = openai.OpenAI(base_url=f"{llm.url}/v1", api_key="unused", max_retries=0)
    full = client.chat.completions.create(
        model=SERVED, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"encoder_result": encode(encoder, names)})
    assert full.choices[0].message.content == ref.text
    assert full.model_extra["epd_timings"]["epd_migration"] > 0
    chunks = list(client.chat.completions.create(
        model=SERVED, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        extra_body={"encoder_result": encode(encoder, names)}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["epd_timings"]["epd_migration"] > 0
    assert_released(encoder, llm, before)


def test_bad_encoder_result_is_400_and_the_server_keeps_serving(encoder, llm, llava_dir):
    messages = messages_for(["city_street.jpg"], "Where is this?")
    before = enc_stats(encoder)["leases"]
    good = encode(encoder, ["city_street.jpg"])
    img = good["images"][0]
    cases = {
        "block_ids": {**img, "block_ids": [*img["block_ids"][:-1], 10_000]},
        "num_tokens": {**img, "num_tokens": 12, "block_ids": img["block_ids"][:3]},
        "hidden_size": {**img, "hidden_size": 32},
        "dtype": {**img, "dtype": "bfloat16"},
    }
    for field, bad_img in cases.items():
        bad = {**good, "images": [bad_img]}
        for stream in (False, True):
            r = httpx.post(f"{llm.url}/v1/chat/completions", timeout=60,
                           json=chat_body(messages, bad, stream=stream))
            assert r.status_code == 400, (field, r.text)
            err = r.json()["error"]
            assert err["param"] == f"encoder_result.images[0].{field}", (field, err)
            assert err["type"] == "invalid_request_error" and err["message"]
    # As the proxy would after a failure: release the leases.
    httpx.post(f"{encoder.url}/v1/encode/release", json={"lease_ids": [img["lease_id"]]})
    assert_released(encoder, llm, before)
    ref = reference_generate(llava_dir, messages, MAX_TOKENS)
    r = httpx.post(f"{llm.url}/v1/chat/completions", timeout=60,
                   json=chat_body(messages, encode(encoder, ["city_street.jpg"])))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == ref.text
    assert_released(encoder, llm, before)


# -- a second pair: acks dropped on the LLM, short leases, then the encoder dies ----------
@pytest.fixture(scope="module")
def short_encoder(llava_dir, tmp_path_factory):
    with ServerProcess(encoder_args(llava_dir, 2.0), log_dir=tmp_path_factory.mktemp("enc2")) as s:
        yield s


@pytest.fixture(scope="module")
def deaf_llm(llava_dir, tmp_path_factory):
    with ServerProcess(llm_args(llava_dir, timeout_s=5.0), env={"EPD_TEST_DROP_ACKS": "1"},
                       log_dir=tmp_path_factory.mktemp("llm2")) as s:
        yield s


def test_lost_ack_is_covered_by_lease_expiry(short_encoder, deaf_llm, llava_dir):
    messages = messages_for(["sunset.png"], "Describe it.")
    ref = reference_generate(llava_dir, messages, MAX_TOKENS)
    r = httpx.post(f"{deaf_llm.url}/v1/chat/completions", timeout=60,
                   json=chat_body(messages, encode(short_encoder, ["sunset.png"])))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == ref.text
    stats = enc_stats(short_encoder)
    assert stats["leases_released"] == 0  # the ack was dropped
    assert wait_until(lambda: enc_stats(short_encoder)["leases"] == 0, 10)
    stats = enc_stats(short_encoder)
    assert stats["leases_expired"] >= 1 and stats["blocks_referenced"] == 0


def test_encoder_killed_before_the_read_is_502(short_encoder, deaf_llm):
    messages = messages_for(["cat.png"], "And this?")
    result = encode(short_encoder, ["cat.png"])
    short_encoder.stop()
    for stream in (False, True):
        r = httpx.post(f"{deaf_llm.url}/v1/chat/completions", timeout=60,
                       json=chat_body(messages, result, stream=stream))
        assert r.status_code == 502, r.text
        err = r.json()["error"]
        assert err["code"] == "epd_migration" and "epd_migration" in err["message"]
    assert deaf_llm.alive()
    s = llm_stats(deaf_llm)
    assert s["kv_blocks_free"] == NUM_BLOCKS and s["mm_blocks_referenced"] == 0
    assert s["num_migrating"] == 0 and s["epd_migrations_failed"] == 2
