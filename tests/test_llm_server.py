"""End-to-end: a real `epd serve --role llm --vision local` subprocess and the openai client.

Every generation is compared with the reference oracle (transformers' greedy generate);
after every test the KV free-block count is back at its start value.
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
from helpers import EXAMPLE_IMAGES, ServerProcess, free_port, run_cli

from epd.models import MultimodalProcessor
from epd.models.reference import reference_generate, reference_generate_text

pytestmark = pytest.mark.e2e

MAX_MODEL_LEN = 256
NUM_BLOCKS = 40  # 640 tokens of KV: two full-context sequences
SERVED = "tiny-llava"
IMAGES = ["cat.png", "sunset.png", "spiral.webp"]


def data_url(name: str) -> str:
    path = EXAMPLE_IMAGES / name
    mime = {"png": "image/png", "jpg": "image/jpeg", "webp": "image/webp"}[path.suffix[1:]]
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"


def image_message(urls: list[str], text: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def server(llava_dir: Path, tmp_path_factory, request):
    args = ["serve", "--role", "llm", "--model", llava_dir, "--vision", "local",
            "--served-model-name", SERVED, "--num-blocks", NUM_BLOCKS,
            "--max-model-len", MAX_MODEL_LEN, "--allowed-local-media-path", EXAMPLE_IMAGES]
    failed_before = request.session.testsfailed
    with ServerProcess(args, log_dir=tmp_path_factory.mktemp("llm-server")) as srv:
        yield srv
        if request.session.testsfailed > failed_before:
            srv.print_logs("tests failed")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def processor(llava_dir):
    return MultimodalProcessor.from_pretrained(llava_dir)


def stats(server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=10).json()["stats"]


def wait_idle(server, start_free: int, timeout_s: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        s = stats(server)
        idle = s["num_running"] == 0 and s["num_waiting"] == 0
        if (idle and s["kv_blocks_free"] == start_free) or time.monotonic() > deadline:
            return s
        time.sleep(0.1)


@pytest.fixture(autouse=True)
def blocks_return(server):
    start = stats(server)
    assert start["kv_blocks_total"] == NUM_BLOCKS
    yield
    end = wait_idle(server, start["kv_blocks_free"])
    assert server.alive()
    assert end["kv_blocks_free"] == start["kv_blocks_free"] == NUM_BLOCKS
    assert end["num_running"] == end["num_waiting"] == 0


def chat(client, messages, max_tokens=12, **kw):
    return client.chat.completions.create(
        model=SERVED, messages=messages, max_tokens=max_tokens, temperature=0, **kw
    )


def stream_chat(client, messages, max_tokens=12, **kw):
    chunks = list(chat(client, messages, max_tokens, stream=True,
                       stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [f for f in finishes if f is not None] == [finishes[-1]]  # exactly once, last
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, finishes[-1], chunks[-1].usage


def assert_same_text(got: str, ref_text: str) -> None:
    # Strict: a trailing incomplete UTF-8 sequence (max_tokens cut inside a character) is
    # U+FFFD in both: the engine flushes what its detokenizer held back at the end.
    assert got == ref_text


def check_against_reference(client, processor, llava_dir, messages, max_tokens=12):
    ref = reference_generate(llava_dir, messages, max_tokens)
    full = chat(client, messages, max_tokens, logprobs=True)
    assert_same_text(full.choices[0].message.content, ref.text)
    assert full.usage.completion_tokens == len(ref.token_ids)
    # token for token: the logprob entries name the generated tokens
    decode = processor.tokenizer.decode
    assert [t.token for t in full.choices[0].logprobs.content] == [
        decode([i]) for i in ref.token_ids
    ]
    images = [m for m in messages if isinstance(m["content"], list)]
    if not images:
        prompt_ids = processor.tokenize(processor.render(messages), []).token_ids
        assert full.usage.prompt_tokens == len(prompt_ids)
    text, finish, usage = stream_chat(client, messages, max_tokens)
    assert text == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        full.usage.prompt_tokens, full.usage.completion_tokens)
    return full


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [SERVED]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_text_chat_matches_reference(client, processor, llava_dir):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Tell me about the sea and the sky."}]
    full = check_against_reference(client, processor, llava_dir, messages, max_tokens=16)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens


@pytest.mark.parametrize("n_images", [1, 2, 3])
def test_image_chat_data_urls(client, processor, llava_dir, n_images):
    messages = image_message([data_url(n) for n in IMAGES[:n_images]], "What is shown?")
    check_against_reference(client, processor, llava_dir, messages)


def test_image_chat_file_paths(client, processor, llava_dir):
    paths = [str(EXAMPLE_IMAGES / "city_street.jpg"), f"file://{EXAMPLE_IMAGES / 'cat.png'}"]
    check_against_reference(client, processor, llava_dir, image_message(paths, "Compare."))


def test_completions(client, llava_dir):
    prompt = "Once upon a time"
    ref = reference_generate_text(llava_dir, prompt, 10)
    out = client.completions.create(model=SERVED, prompt=prompt, max_tokens=10, temperature=0)
    assert_same_text(out.choices[0].text, ref.text)
    assert out.usage.completion_tokens == len(ref.token_ids)
    chunks = list(client.completions.create(model=SERVED, prompt=prompt, max_tokens=10,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] is not None
    # a token-id prompt is the same request
    ids = MultimodalProcessor.from_pretrained(llava_dir).tokenize(prompt, []).token_ids
    by_ids = client.completions.create(model=SERVED, prompt=ids, max_tokens=10, temperature=0,
                                       logprobs=2)
    assert by_ids.choices[0].text == out.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids) == out.usage.prompt_tokens
    lp = by_ids.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(ref.token_ids)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs if top is not None)


def test_logprobs_shape(client):
    out = chat(client, [{"role": "user", "content": "Count to five."}], max_tokens=6,
               logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for tok in content:
        assert len(tok.top_logprobs) == 3
        assert tok.logprob <= 0
        # greedy: the chosen token is the most likely one
        assert tok.logprob == pytest.approx(max(t.logprob for t in tok.top_logprobs), abs=1e-5)
        assert tok.bytes == list(tok.token.encode())


def test_stop_string(client):
    base = chat(client, [{"role": "user", "content": "Say something long."}], max_tokens=16)
    text = base.choices[0].message.content
    if len(text.strip()) < 4:
        pytest.skip("reference text too short to cut")
    stop = text.strip()[2:4]
    out = chat(client, [{"role": "user", "content": "Say something long."}], max_tokens=16,
               stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == text[: text.index(stop)]


def _post(server, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content,
                      headers={"content-type": "application/json"}, timeout=30)


def _chat_body(**kw) -> dict:
    body = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    body.update(kw)
    return body


LONG = "word " * (MAX_MODEL_LEN + 20)
BAD_INPUTS = {
    "malformed_json": ("/v1/chat/completions", b'{"model": "x", "messages": [', 400, None),
    "unknown_model": ("/v1/chat/completions", _chat_body(model="gpt-9"), 404, "model"),
    "bad_base64": ("/v1/chat/completions", _chat_body(
        messages=image_message(["data:image/png;base64,@@not-base64@@"], "x")),
        400, "messages[0].content[0]"),
    "non_image_bytes": ("/v1/chat/completions", _chat_body(
        messages=image_message([f"data:image/png;base64,{base64.b64encode(b'hello').decode()}"],
                               "x")), 400, "messages[0].content[0]"),
    "path_outside_allowed": ("/v1/chat/completions", _chat_body(
        messages=image_message(["/etc/passwd"], "x")), 400, "messages[0].content[0]"),
    "negative_max_tokens": ("/v1/chat/completions", _chat_body(max_tokens=-1), 400, "max_tokens"),
    "negative_temperature": ("/v1/chat/completions", _chat_body(temperature=-0.5), 400,
                             "temperature"),
    "top_p_above_one": ("/v1/chat/completions", _chat_body(top_p=1.5), 400, "top_p"),
    "n_above_one": ("/v1/chat/completions", _chat_body(n=2), 400, "n"),
    "prompt_too_long_chat": ("/v1/chat/completions", _chat_body(
        messages=[{"role": "user", "content": LONG}]), 400, "messages"),
    "prompt_too_long_completion": ("/v1/completions", {"model": SERVED, "prompt": LONG}, 400,
                                   "prompt"),
    "prompt_plus_max_tokens": ("/v1/chat/completions", _chat_body(max_tokens=MAX_MODEL_LEN), 400,
                               "max_tokens"),
    "bad_token_id": ("/v1/completions", {"model": SERVED, "prompt": [1, 10**9]}, 400, "prompt"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input(server, client, case):
    path, body, status, param = BAD_INPUTS[case]
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert err["message"] and err["type"]
    # still serving
    ok = chat(client, [{"role": "user", "content": "hi"}], max_tokens=2)
    assert ok.usage.completion_tokens >= 1


def aborted_count(server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith('epd_requests_total{finish_reason="abort"}'):
            return float(line.split()[-1])
    return 0.0


def test_disconnect_mid_stream_frees_blocks(server):
    before = aborted_count(server)
    body = _chat_body(max_tokens=MAX_MODEL_LEN - 20, ignore_eos=True, stream=True)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert stats(server)["kv_blocks_free"] < NUM_BLOCKS  # the sequence holds blocks
    wait_idle(server, NUM_BLOCKS)
    assert aborted_count(server) == before + 1
    # blocks_return (autouse) checks that the abort freed every block


def test_disconnect_non_streaming_frees_blocks(server):
    before = aborted_count(server)
    body = _chat_body(max_tokens=MAX_MODEL_LEN - 20, ignore_eos=True)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=0.2)
    wait_idle(server, NUM_BLOCKS)
    assert aborted_count(server) == before + 1


def test_metrics(server, client):
    chat(client, [{"role": "user", "content": "hi"}], max_tokens=3)
    _post(server, "/v1/chat/completions", _chat_body(temperature=-1))
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for name in ("epd_num_requests_running", "epd_num_requests_waiting", "epd_kv_blocks_used",
                 "epd_kv_blocks_free", "epd_kv_blocks_total", "epd_prompt_tokens_total",
                 "epd_generation_tokens_total", "epd_generation_tokens_per_second",
                 "epd_time_to_first_token_seconds_bucket",
                 "epd_time_per_output_token_seconds_bucket", "epd_requests_total",
                 'epd_request_errors_total{type="invalid_request_error"}'):
        assert name in text, name
    assert f"epd_kv_blocks_total {float(NUM_BLOCKS)}" in text


def test_no_vision_server_explains_deployment(llava_dir, tmp_path):
    # --proxy-url points at a port nobody listens on: registration fails, serving does not
    args = ["serve", "--role", "llm", "--model", llava_dir, "--num-blocks", 8,
            "--proxy-url", f"http://127.0.0.1:{free_port()}"]
    with ServerProcess(args, log_dir=tmp_path) as srv:
        body = {"model": Path(llava_dir).name, "max_tokens": 2,
                "messages": image_message([data_url("cat.png")], "what is it?")}
        r = _post(srv, "/v1/chat/completions", body)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "messages[0].content[0]"
        assert "epd launch" in err["message"] and "--vision local" in err["message"]
        text_ok = _post(srv, "/v1/chat/completions",
                        {**body, "messages": [{"role": "user", "content": "hi"}]})
        assert text_ok.status_code == 200 and text_ok.json()["usage"]["completion_tokens"] >= 1
        # no max_tokens: generate up to what the KV cache (8 blocks of 16) can hold
        unset = _post(srv, "/v1/chat/completions", {
            "model": body["model"], "ignore_eos": True,
            "messages": [{"role": "user", "content": "hi"}]}).json()
        assert unset["choices"][0]["finish_reason"] == "length"
        assert unset["usage"]["total_tokens"] == 8 * 16
        assert srv.stop() == 0  # SIGTERM: clean shutdown
    assert "proxy" in srv.logs() and "unreachable" in srv.logs()


def test_generate_cli_prints_reference(llava_dir):
    image = EXAMPLE_IMAGES / "cat.png"
    ref = reference_generate(llava_dir, image_message([str(image)], "Describe it."), 8)
    proc = run_cli(["generate", "--model", llava_dir, "--image", image, "--prompt",
                    "Describe it.", "--max-tokens", 8])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.endswith("\n")
    assert_same_text(proc.stdout[:-1], ref.text)
