"""End-to-end E + P + D through the proxy: a real encoder, a prefill engine (smaller KV pool,
short lease), two decode engines and two proxies (E+P+D, and P+D without an encoder).

Every reply equals the reference oracle's greedy text; afterwards P's and the D's free KV
blocks and the encoder's referenced blocks / leases are back at their start values. The
last test kills a decode engine mid-stream (so it runs last in this module).
"""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from helpers import EXAMPLE_IMAGES, ServerProcess
from helpers.chat import messages, reference, wait_for

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8
P_BLOCKS, D_BLOCKS = 32, 96
LEASE_S = 3


class PDCluster:
    def __init__(self, model_dir, log_dir) -> None:
        self.model_dir, self.log_dir = str(model_dir), log_dir
        self.servers: list[ServerProcess] = []

    def add(self, name: str, *args) -> ServerProcess:
        srv = ServerProcess([str(a) for a in args], log_dir=self.log_dir, name=name)
        self.servers.append(srv)
        return srv

    def start(self) -> None:
        serve = ["serve", "--model", self.model_dir, "--role"]
        kv = ["--max-model-len", 512, "--served-model-name", "tiny"]
        self.encoder = self.add(
            "encoder", *serve, "encoder", "--transfer", "tcp", "--mm-block-tokens", 16,
            "--mm-num-blocks", 256, "--allowed-local-media-path", str(EXAMPLE_IMAGES),
        )  # fmt: skip
        self.prefill = self.add(
            "prefill", *serve, "prefill", "--num-blocks", P_BLOCKS, "--lease-seconds", LEASE_S, *kv
        )
        self.decodes = [
            self.add(f"decode{i}", *serve, "decode", "--num-blocks", D_BLOCKS, *kv)
            for i in range(2)
        ]
        health = ["--health-interval", "0.3", "--health-timeout", "1.0"]
        pd_nodes = ["--prefill", self.prefill.url]
        for d in self.decodes:
            pd_nodes += ["--decode", d.url]
        self.proxy = self.add("proxy", "proxy", "--encoder", self.encoder.url, *pd_nodes, *health)
        self.text_proxy = self.add("text-proxy", "proxy", *pd_nodes, *health)
        # Start everything at once (ports are fixed up front): startup is mostly imports.
        with ThreadPoolExecutor(len(self.servers)) as pool:
            list(pool.map(ServerProcess.start, self.servers))
        # The proxies checked the engines while those were starting: wait until all are in.
        for proxy, n in ((self.proxy, 4), (self.text_proxy, 3)):
            assert wait_for(lambda p=proxy, n=n: self.healthy_nodes(p) == n), proxy.name

    def healthy_nodes(self, proxy: ServerProcess) -> int:
        nodes = httpx.get(f"{proxy.url}/nodes", timeout=10).json()["nodes"]
        return sum(n["healthy"] for n in nodes)

    def stop(self) -> None:
        for srv in reversed(self.servers):
            died = not srv.alive()
            srv.stop()
            if died and srv.name != "killed":
                srv.print_logs("died during the tests")

    def client(self, proxy: ServerProcess) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0)

    def chat(self, images: tuple[str, ...], stream: bool, text: str, proxy=None) -> str:
        client = self.client(proxy or self.proxy)
        kwargs = dict(
            model="tiny", messages=messages(images, text), max_tokens=MAX_TOKENS, temperature=0
        )
        if not stream:
            return client.chat.completions.create(**kwargs).choices[0].message.content
        out = []
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                out.append(chunk.choices[0].delta.content)
        return "".join(out)

    def free(self, srv: ServerProcess) -> int:
        return httpx.get(f"{srv.url}/health", timeout=10).json()["stats"]["kv_blocks_free"]

    def prefill_stats(self) -> dict:
        return httpx.get(f"{self.prefill.url}/health", timeout=10).json()["stats"]

    def encoder_stats(self) -> dict:
        stats = httpx.get(f"{self.encoder.url}/v1/encode/stats", timeout=10).json()
        return {k: stats[k] for k in ("blocks_referenced", "leases")}

    def live_engines(self) -> list[ServerProcess]:
        return [s for s in [self.prefill, *self.decodes] if s.alive()]

    def snapshot(self) -> dict:
        return {
            "free": {s.name: self.free(s) for s in self.live_engines()},
            "encoder": self.encoder_stats(),
        }

    def nodes(self, role: str) -> list[dict]:
        nodes = httpx.get(f"{self.proxy.url}/nodes", timeout=10).json()["nodes"]
        return [n for n in nodes if n["role"] == role]


@pytest.fixture(scope="module")
def pd(llava_dir, tmp_path_factory):
    c = PDCluster(llava_dir, tmp_path_factory.mktemp("epd-pd-e2e"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture
def nothing_leaks(pd):
    start = pd.snapshot()
    yield
    assert wait_for(lambda: pd.snapshot() == start), (pd.snapshot(), start)


def test_sixteen_concurrent_mixed_requests(pd, llava_dir, nothing_leaks):
    combos = [(), ("cat.png",), ("city_street.jpg", "sunset.png"), ("file:spiral.webp",)]
    jobs = [(combos[i % 4], i % 3 == 0, f"Request {i % 8}: describe.") for i in range(16)]
    expected = [reference(llava_dir, imgs, text) for imgs, _, text in jobs]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda j: pd.chat(*j), jobs))
    assert got == expected
    metrics = httpx.get(f"{pd.proxy.url}/metrics", timeout=10).text
    for name in (
        'epd_proxy_requests_total{path="pd"} 4.0',
        'epd_proxy_requests_total{path="epd_pd"} 12.0',
        "epd_proxy_prefill_seconds_count 16.0",
        "epd_proxy_encode_seconds_count 12.0",
        'epd_proxy_migrate_seconds_count{kind="pd"} 16.0',
    ):
        assert name in metrics, metrics
    # Both decode engines took part (round robin), each migrating KV blocks from P.
    for d in pd.decodes:
        assert httpx.get(f"{d.url}/health", timeout=10).json()["stats"]["pd_migrations"] > 0


def test_pd_without_encoder_serves_text(pd, llava_dir, nothing_leaks):
    for stream in (False, True):
        text = "Tell me a story."
        assert pd.chat((), stream, text, proxy=pd.text_proxy) == reference(llava_dir, (), text)
    with pytest.raises(openai.APIStatusError) as info:
        pd.chat(("cat.png",), False, "What?", proxy=pd.text_proxy)
    assert info.value.status_code == 503 and "'encoder'" in info.value.message


def test_n_above_one_is_refused(pd):
    with pytest.raises(openai.BadRequestError) as info:
        pd.client(pd.proxy).chat.completions.create(
            model="tiny", messages=messages((), "hi"), max_tokens=2, n=2
        )
    assert info.value.body["param"] == "n"


def test_decode_killed_mid_stream(pd, llava_dir):
    p_free = pd.free(pd.prefill)
    body = {
        "model": "tiny",
        "messages": messages(("cat.png",), "Keep going."),
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    events: list[str] = []
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{pd.proxy.url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            victim = None
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line.removeprefix("data: "))
                if len(events) == 3:
                    busy = [n["url"] for n in pd.nodes("decode") if n["in_flight"] == 1]
                    assert len(busy) == 1
                    victim = next(d for d in pd.decodes if d.url == busy[0])
                    os.killpg(victim.proc.pid, signal.SIGKILL)
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "decode_failed" and victim.url in err["message"]
    victim.name = "killed"
    # P's blocks are back (acked by D before it died, or at the latest by lease expiry).
    assert wait_for(lambda: pd.free(pd.prefill) == p_free, timeout_s=LEASE_S + 10)
    assert wait_for(lambda: pd.prefill_stats()["pd_leases_active"] == 0)
    # The proxy takes the dead D out; every later request goes to the other one and is exact.
    assert wait_for(
        lambda: not next(n for n in pd.nodes("decode") if n["url"] == victim.url)["healthy"]
    )
    survivor = next(d for d in pd.decodes if d is not victim)
    d_free = pd.free(survivor)
    for stream, images in ((False, ()), (True, ("cat.png",)), (False, ("sunset.png",))):
        text = "After the crash."
        assert pd.chat(images, stream, text) == reference(llava_dir, images, text)
    assert wait_for(lambda: pd.free(survivor) == d_free and pd.free(pd.prefill) == p_free)
    assert wait_for(lambda: pd.encoder_stats()["leases"] == 0)
