"""End-to-end: a real encoder, a real LLM engine (no local vision) and the proxy.

Every reply equals the reference oracle's greedy text; afterwards the encoder's referenced
blocks / leases and the LLM's free KV blocks are back at their start values. The last test
kills the encoder (so it runs last in this module) and restarts it on the same port.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from helpers import EXAMPLE_IMAGES, ServerProcess, free_port
from helpers.chat import MAX_TOKENS, messages, reference, wait_for

pytestmark = pytest.mark.e2e

NUM_BLOCKS = 96
IMAGES = ["cat.png", "sunset.png", "spiral.webp", "city_street.jpg"]
class Cluster:
    def __init__(self, model_dir, log_dir) -> None:
        self.model_dir, self.log_dir = model_dir, log_dir
        self.encoder_port = free_port()
        self.encoder = self.llm = self.proxy = None

    def start(self) -> None:
        model_dir, log_dir = self.model_dir, self.log_dir
        self.encoder = self.start_encoder()
        llm_args = [
            "serve",
            "--role",
            "llm",
            "--model",
            model_dir,
            "--num-blocks",
            NUM_BLOCKS,
            "--max-model-len",
            512,
            "--served-model-name",
            "tiny",
        ]
        self.llm = ServerProcess(llm_args, log_dir=log_dir, name="llm").start()
        proxy_args = [
            "proxy",
            "--encoder",
            self.encoder.url,
            "--llm",
            self.llm.url,
            "--health-interval",
            "0.3",
            "--health-timeout",
            "1.0",
        ]
        self.proxy = ServerProcess(proxy_args, log_dir=log_dir, name="proxy").start()
        self.client = openai.OpenAI(base_url=f"{self.proxy.url}/v1", api_key="x", max_retries=0)

    def start_encoder(self) -> ServerProcess:
        args = [
            "serve",
            "--role",
            "encoder",
            "--model",
            self.model_dir,
            "--transfer",
            "tcp",
            "--mm-block-tokens",
            "16",
            "--mm-num-blocks",
            "256",
            "--allowed-local-media-path",
            str(EXAMPLE_IMAGES),
        ]
        return ServerProcess(
            args, port=self.encoder_port, log_dir=self.log_dir, name="encoder"
        ).start()

    def stop(self) -> None:
        for srv in (self.proxy, self.llm, self.encoder):
            if srv is None:
                continue
            died = not srv.alive()
            srv.stop()
            if died:
                srv.print_logs("died during the tests")

    def chat(self, images: tuple[str, ...], stream: bool, text: str = "What is in the picture?"):
        kwargs = dict(
            model="tiny", messages=messages(images, text), max_tokens=MAX_TOKENS, temperature=0
        )
        if not stream:
            r = self.client.chat.completions.create(**kwargs)
            return r.choices[0].message.content, r.usage
        out = []
        for chunk in self.client.chat.completions.create(**kwargs, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                out.append(chunk.choices[0].delta.content)
        return "".join(out), None

    def encoder_stats(self) -> dict:
        return httpx.get(f"{self.encoder.url}/v1/encode/stats", timeout=10).json()

    def llm_free(self) -> int:
        return httpx.get(f"{self.llm.url}/health", timeout=10).json()["stats"]["kv_blocks_free"]

    def node(self, role: str) -> dict:
        nodes = httpx.get(f"{self.proxy.url}/nodes", timeout=10).json()["nodes"]
        return next(n for n in nodes if n["role"] == role)


@pytest.fixture(scope="module")
def cluster(llava_dir, tmp_path_factory):
    c = Cluster(llava_dir, tmp_path_factory.mktemp("proxy-e2e"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture
def nothing_leaks(cluster):
    """Encoder refs/leases and LLM free blocks are back at their start values afterwards."""
    enc, free = cluster.encoder_stats(), cluster.llm_free()
    yield
    assert wait_for(lambda: cluster.llm_free() == free), (cluster.llm_free(), free)
    keys = ("blocks_referenced", "leases")
    assert wait_for(lambda: all(cluster.encoder_stats()[k] == enc[k] for k in keys)), (
        cluster.encoder_stats(),
        enc,
    )


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "images", [(), ("cat.png",), ("sunset.png", "file:spiral.webp", "cat.png")]
)
def test_reply_equals_reference(cluster, llava_dir, nothing_leaks, images, stream):
    text, usage = cluster.chat(images, stream)
    assert text == reference(llava_dir, images)
    if usage is not None:
        assert 0 < usage.completion_tokens <= MAX_TOKENS


def test_sixteen_concurrent_requests(cluster, llava_dir, nothing_leaks):
    combos = [(), ("cat.png",), ("city_street.jpg", "sunset.png"), tuple(IMAGES[:3])]
    jobs = [(combos[i % 4], i % 2 == 0, f"Request {i}: describe.") for i in range(16)]
    expected = [reference(llava_dir, imgs, text) for imgs, _, text in jobs]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda j: cluster.chat(j[0], j[1], j[2])[0], jobs))
    assert got == expected
    metrics = httpx.get(f"{cluster.proxy.url}/metrics", timeout=10).text
    for name in (
        "epd_proxy_encode_seconds",
        "epd_proxy_time_to_first_token_seconds",
        "epd_proxy_time_per_output_token_seconds",
        'epd_proxy_requests_total{path="image"}',
        'epd_proxy_nodes_healthy{role="encoder"} 1.0',
    ):
        assert name in metrics


def test_models_and_health(cluster):
    models = cluster.client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    health = httpx.get(f"{cluster.proxy.url}/health", timeout=10).json()
    assert health["nodes"]["encoder"] == {"healthy": 1, "total": 1}
    assert health["nodes"]["llm"] == {"healthy": 1, "total": 1}


@pytest.mark.parametrize("images", [(), ("spiral.webp",)])
def test_client_disconnect_mid_stream_frees_everything(cluster, nothing_leaks, images):
    body = {
        "model": "tiny",
        "messages": messages(images),
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{cluster.proxy.url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: {")
                if seen == 3:
                    break
    assert seen == 3
    # The proxy closed the upstream stream: the LLM aborted (nothing_leaks checks its blocks).
    assert wait_for(lambda: cluster.node("llm")["in_flight"] == 0)
    metrics = httpx.get(f"{cluster.proxy.url}/metrics", timeout=10).text
    assert 'epd_proxy_errors_total{kind="client_disconnect"}' in metrics


def test_encoder_killed_then_restarted(cluster, llava_dir):
    free = cluster.llm_free()
    pid = cluster.encoder.proc.pid
    os.killpg(pid, signal.SIGSTOP)  # frozen: the next encodes hang in flight
    try:
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(cluster.chat, ("cat.png",), s) for s in (False, True, False)]
            time.sleep(0.5)
            os.killpg(pid, signal.SIGKILL)
            errors = []
            for f in futures:
                with pytest.raises(openai.APIError) as info:
                    f.result(timeout=60)
                errors.append(info.value)
    finally:
        cluster.encoder.stop()
    assert all(getattr(e, "code", None) == "encode_failed" for e in errors), errors
    assert wait_for(lambda: not cluster.node("encoder")["healthy"])
    # Text keeps working; an image request now names the missing role.
    assert cluster.chat((), False)[0] == reference(llava_dir, ())
    with pytest.raises(openai.APIStatusError) as info:
        cluster.chat(("cat.png",), False)
    assert info.value.status_code == 503 and "'encoder'" in info.value.message
    # Same port again: the health loop puts it back in rotation.
    cluster.encoder = cluster.start_encoder()
    assert wait_for(lambda: cluster.node("encoder")["healthy"])
    assert cluster.chat(("cat.png",), True)[0] == reference(llava_dir, ("cat.png",))
    assert wait_for(lambda: cluster.llm_free() == free)
