"""Shared helpers of the serving benchmarks: pinned server processes, a streaming load
generator, unique example images and percentiles.

Invariants: every process started through `Procs` is a `python -m epd.cli ...` child in its
own process group, pinned with `os.sched_setaffinity` (what `taskset -c` does) and given
`OMP_NUM_THREADS` (torch's intra-op threads); `Procs` stops them all (SIGTERM, then SIGKILL)
when its `with` block exits, also on Ctrl-C and on SIGTERM (turned into KeyboardInterrupt).
Benchmarks are not tests: nothing here asserts a speed.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
IMAGES = REPO / "examples" / "images"
IMAGE_NAMES = ["sunset.png", "bar_chart.jpg", "city_street.jpg", "cat.png", "spiral.webp"]
WORDS = "the quick brown fox jumps over the lazy dog near the river bank at dawn".split()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def bench_model_dir(path: str | None) -> Path:
    if path:
        return Path(path)
    from epd.models.tiny import default_model_dir

    return default_model_dir("llava", "bench")  # cached under $EPD_CACHE_DIR or ~/.cache/epd


def host_load() -> str:
    """`uptime`'s load averages plus the core count, for the results file."""
    one, five, fifteen = os.getloadavg()
    return f"cpus: {os.cpu_count()}, load average: {one:.2f}, {five:.2f}, {fifteen:.2f}"


def _on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt


@dataclass
class Proc:
    name: str
    args: list[str]
    cpus: set[int] | None
    threads: int
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Procs:
    """Starts pinned `epd` processes; stops every one of them on exit, whatever happens."""

    def __init__(self, log_dir: Path | None = None) -> None:
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="epd-bench-"))
        self.procs: list[Proc] = []
        self._logs: list = []
        self._old_handler = None

    def __enter__(self) -> Procs:
        self._old_handler = signal.signal(signal.SIGTERM, _on_sigterm)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop_all()
        finally:
            signal.signal(signal.SIGTERM, self._old_handler or signal.SIG_DFL)

    def start(self, name: str, args: list[str], *, cpus: set[int] | None, threads: int) -> Proc:
        port = free_port()
        p = Proc(name, [*args, "--host", "127.0.0.1", "--port", str(port)], cpus, threads,
                 port, self.log_dir / f"{name}-{port}.log")
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
                   HF_HUB_OFFLINE="1")
        log = open(p.log_path, "wb")  # closed in stop_all
        self._logs.append(log)

        def pin() -> None:  # in the child, before exec: like `taskset -c`
            if cpus is not None:
                os.sched_setaffinity(0, cpus)

        p.proc = subprocess.Popen([sys.executable, "-m", "epd.cli", *p.args], cwd=REPO,
                                  env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True, preexec_fn=pin)
        self.procs.append(p)
        return p

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(self.procs)
        while pending:
            for p in list(pending):
                if p.proc.poll() is not None:
                    raise RuntimeError(f"{p.name} exited ({p.proc.returncode}):\n{tail(p)}")
                try:
                    if httpx.get(p.url + "/health", timeout=2.0).status_code == 200:
                        pending.remove(p)
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"{pending[0].name} not healthy:\n{tail(pending[0])}")
            time.sleep(0.3)

    def stop_all(self, grace_s: float = 15.0) -> None:
        for p in reversed(self.procs):
            _killpg(p.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _killpg(p.proc, signal.SIGKILL)
                p.proc.wait(10)
        self.procs.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()


def _killpg(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        proc.send_signal(sig)


def tail(p: Proc, chars: int = 3000) -> str:
    try:
        return p.log_path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def model_name(base_url: str) -> str:
    return httpx.get(f"{base_url}/v1/models", timeout=10.0).json()["data"][0]["id"]


# ---- workload ----

def text_prompt(i: int, n_words: int) -> str:
    words = [WORDS[(i * 7 + k) % len(WORDS)] for k in range(n_words)]
    return f"Request {i}: " + " ".join(words)


def unique_image_urls(n: int, seed: int = 0) -> list[str]:
    """`n` PNG data URLs of the example images, each with a distinct coloured square at its
    centre: no two requests share an image, so no cache (encoder or prefix) can serve them."""
    from PIL import Image, ImageDraw

    base = [Image.open(IMAGES / name).convert("RGB") for name in IMAGE_NAMES]
    out = []
    for i in range(n):
        img = base[i % len(base)].copy()
        w, h = img.size
        k = seed * 1_000_003 + i
        colour = (k * 37 % 256, k * 91 % 256, k * 53 % 256)
        ImageDraw.Draw(img).rectangle([w // 2 - 12, h // 2 - 12, w // 2 + 12, h // 2 + 12],
                                      fill=colour)
        buf = io.BytesIO()
        img.save(buf, format="PNG", compress_level=1)
        out.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    return out


def chat_body(model: str, text: str, max_tokens: int, image_urls: list[str] = ()) -> dict:
    content: str | list[dict] = text
    if image_urls:
        content = [{"type": "image_url", "image_url": {"url": u}} for u in image_urls]
        content.append({"type": "text", "text": text})
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


@dataclass
class Result:
    kind: str
    start: float
    ttft: float | None = None
    end: float | None = None
    tokens: int = 0
    error: str | None = None
    timings: dict | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.end is None or self.tokens < 2:
            return None
        return (self.end - self.start - self.ttft) / (self.tokens - 1)


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict, kind: str) -> Result:
    """One streamed chat request; TTFT at the first content delta, tokens from the usage chunk."""
    r = Result(kind, time.perf_counter())
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    r.error = str(obj["error"])[:300]
                    return r
                if obj.get("epd_timings"):
                    r.timings = obj["epd_timings"]
                if obj.get("usage"):
                    r.tokens = obj["usage"]["completion_tokens"]
                for ch in obj.get("choices") or ():
                    if r.ttft is None and (ch.get("delta") or {}).get("content") is not None:
                        r.ttft = time.perf_counter() - r.start
        r.end = time.perf_counter()
    except (httpx.HTTPError, ValueError) as e:
        r.error = f"{type(e).__name__}: {e}"
    return r


def new_client(timeout_s: float = 600.0) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=timeout_s, trust_env=False,
                             limits=httpx.Limits(max_connections=256))


async def closed_loop(client, url: str, make_body, concurrency: int, deadline: float,
                      kind: str = "text", stagger_s: float = 0.0) -> list[Result]:
    """`concurrency` workers, each sending its next request when the previous one ends,
    until `deadline` (perf_counter); requests in flight at the deadline complete. Worker j
    starts after j * `stagger_s`, so the workers do not run in lock-step waves."""
    results: list[Result] = []
    counter = iter(range(10**9))

    async def worker(j: int) -> None:
        await asyncio.sleep(j * stagger_s)
        while time.perf_counter() < deadline:
            results.append(await stream_chat(client, url, make_body(next(counter)), kind))

    await asyncio.gather(*(worker(j) for j in range(concurrency)))
    return results


async def open_loop(client, url: str, make_body, rate: float, deadline: float,
                    kind: str = "image") -> list[Result]:
    """One request every 1/rate seconds (steady, not Poisson) until `deadline`."""
    tasks = []
    t0, i = time.perf_counter(), 0
    while rate > 0 and time.perf_counter() < deadline:
        tasks.append(asyncio.create_task(stream_chat(client, url, make_body(i), kind)))
        i += 1
        await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
    return list(await asyncio.gather(*tasks))


# ---- statistics ----

def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; NaN when empty."""
    v = sorted(values)
    if not v:
        return math.nan
    pos = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarize(results: list[Result], wall_s: float) -> dict:
    ok = [r for r in results if r.error is None]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    return {
        "n": len(ok), "errors": len(results) - len(ok),
        "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
        "tpot_p50": percentile(tpot, 50), "tpot_p99": percentile(tpot, 99),
        "tokens": sum(r.tokens for r in ok), "wall_s": wall_s,
    }


def first_errors(results: list[Result], k: int = 3) -> list[str]:
    return [r.error for r in results if r.error][:k]


def ms(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x * 1000:.1f}"


def ratio(a: float, b: float) -> str:
    return "n/a" if math.isnan(a) or math.isnan(b) or b == 0 else f"{a / b:.2f}x"
