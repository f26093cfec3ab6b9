"""`epd launch`: encoder(s) + LLM engine(s) + proxy on this machine, in one command
(`--pd`: encoder(s) + prefill engine(s) + decode engine(s) + a proxy in PD mode).

Invariants: every child is a `python -m epd.cli ...` subprocess in its own process group,
bound to --host (default loopback) and logging to its own file; whatever happens (Ctrl-C,
SIGTERM, a child dying, a failed start), every child is stopped before `run` returns
(SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

EXAMPLE_IMAGE = Path(__file__).resolve().parents[1] / "examples" / "images" / "cat.png"
EXAMPLE_PROMPT = "Describe this image."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the tiny llava)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address of every process")
    parser.add_argument("--port", type=int, default=8080, help="the proxy's port")
    parser.add_argument("--encoders", type=int, default=1)
    parser.add_argument("--llms", type=int, default=1)
    parser.add_argument("--base-port", type=int, default=None, help="first engine port")
    parser.add_argument("--pd", action="store_true", help="encoder + prefill + decode")
    parser.add_argument("--prefills", type=int, default=1, help="prefill engines (with --pd)")
    parser.add_argument("--decodes", type=int, default=1, help="decode engines (with --pd)")
    parser.add_argument("--extra-llm-args", default="", help="extra `epd serve --role llm` flags")
    parser.add_argument("--extra-prefill-args", default="", help="extra prefill engine flags")
    parser.add_argument("--extra-decode-args", default="", help="extra decode engine flags")
    parser.add_argument("--extra-encoder-args", default="", help="extra encoder flags")
    parser.add_argument("--extra-proxy-args", default="", help="extra `epd proxy` flags")
    parser.add_argument("--no-example", action="store_true", help="skip the example request")
    parser.add_argument(
        "--exit-after-example", action="store_true", help="stop everything after the example"
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="for the example request")
    parser.add_argument("--startup-timeout", type=float, default=300.0, metavar="SECONDS")
    parser.add_argument("--log-dir", default=None, help="child logs (default: a temp dir)")


@dataclass
class Child:
    name: str
    url: str
    cmd: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    _log: object = field(default=None, repr=False)

    def start(self) -> None:
        self._log = open(self.log_path, "wb")  # closed in Launcher.stop_all
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _say(msg: str = "") -> None:
    print(msg, flush=True)


class Launcher:
    def __init__(self, args: argparse.Namespace, model: str) -> None:
        self.args = args
        self.model = model
        self.children: list[Child] = []
        self.log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="epd-launch-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.proxy_url = f"http://{args.host}:{args.port}"

    def plan(self) -> None:
        a = self.args
        next_port = a.base_port

        def port() -> int:
            nonlocal next_port
            if next_port is None:
                return _free_port(a.host)
            next_port += 1
            return next_port - 1

        py = [sys.executable, "-m", "epd.cli"]
        for role, count, extra in self.engines():
            for i in range(count):
                p = port()
                cmd = [*py, "serve", "--role", role, "--model", self.model]
                cmd += ["--host", a.host, "--port", str(p), *shlex.split(extra)]
                self._add(f"{role}{i}", f"http://{a.host}:{p}", cmd)
        cmd = [*py, "proxy", "--host", a.host, "--port", str(a.port)]
        if a.pd:
            cmd += ["--mode", "pd"]
        for c in self.children:
            cmd += [f"--{c.name.rstrip('0123456789')}", c.url]
        self._add("proxy", self.proxy_url, cmd + shlex.split(a.extra_proxy_args))

    def engines(self) -> list[tuple[str, int, str]]:
        """(role, count, extra flags) of the engine processes, in start order."""
        a = self.args
        engines = [("encoder", a.encoders, a.extra_encoder_args)]
        if a.pd:
            engines += [
                ("prefill", a.prefills, a.extra_prefill_args),
                ("decode", a.decodes, a.extra_decode_args),
            ]
        else:
            engines.append(("llm", a.llms, a.extra_llm_args))
        return engines

    def _add(self, name: str, url: str, cmd: list[str]) -> None:
        self.children.append(Child(name, url, cmd, self.log_dir / f"{name}.log"))

    def start_all(self) -> bool:
        for c in self.children:
            c.start()
            _say(f"started {c.name:9s} {c.url}  (log: {c.log_path})")
        deadline = time.monotonic() + self.args.startup_timeout
        pending = list(self.children)
        with httpx.Client(trust_env=False, timeout=2.0) as client:
            while pending:
                for c in list(pending):
                    if not c.alive():
                        self._report_failure(c, f"exited with code {c.proc.returncode}")
                        return False
                    try:
                        if client.get(f"{c.url}/health").status_code == 200:
                            pending.remove(c)
                    except httpx.HTTPError:
                        pass
                if pending and time.monotonic() > deadline:
                    self._report_failure(pending[0], "did not become healthy in time")
                    return False
                time.sleep(0.3)
        return True

    def _report_failure(self, c: Child, why: str) -> None:
        _say(f"epd launch: {c.name} ({c.url}) {why}; last lines of {c.log_path}:")
        _say(c.log_tail())

    def dead_child(self) -> Child | None:
        return next((c for c in self.children if not c.alive()), None)

    def stop_all(self, grace_s: float = 15.0) -> None:
        for c in reversed(self.children):  # proxy first: no new requests reach the engines
            if c.alive():
                _signal(c.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in self.children:
            if c.proc is None:
                continue
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(c.proc, signal.SIGKILL)
                c.proc.wait(10)
            if c._log is not None:
                c._log.close()
                c._log = None


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the child's whole group (it may have its own children)
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


def example_data_url() -> str:
    if EXAMPLE_IMAGE.exists():
        return "data:image/png;base64," + base64.b64encode(EXAMPLE_IMAGE.read_bytes()).decode()
    from PIL import Image  # installed without the repo's examples: draw one

    img = Image.linear_gradient("L").convert("RGB").resize((96, 96))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def print_usage(proxy_url: str, model_name: str, max_tokens: int) -> None:
    body = {
        "model": model_name,
        "max_tokens": max_tokens,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,IMG"}},
                    {"type": "text", "text": EXAMPLE_PROMPT},
                ],
            }
        ],
    }
    data = json.dumps(body).replace("IMG", "'\"$IMG\"'")
    _say(f"\nepd is up. OpenAI-compatible endpoint: {proxy_url}/v1  (model: {model_name})")
    _say("\nTry it with curl:")
    _say(f"  IMG=$(base64 -w0 {EXAMPLE_IMAGE})")
    _say(f"  curl -s {proxy_url}/v1/chat/completions -H 'Content-Type: application/json' \\")
    _say(f"    -d '{data}'")
    _say("\nor with the openai Python client:")
    _say("  from openai import OpenAI")
    _say(f'  client = OpenAI(base_url="{proxy_url}/v1", api_key="none")')
    _say("  reply = client.chat.completions.create(")
    _say(f'      model="{model_name}", max_tokens={max_tokens},')
    _say('      messages=[{"role": "user", "content": [')
    _say('          {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},')
    _say(f'          {{"type": "text", "text": "{EXAMPLE_PROMPT}"}}]}}])')
    _say("  print(reply.choices[0].message.content)\n")


def run_example(proxy_url: str, model_name: str, max_tokens: int) -> bool:
    from openai import OpenAI

    _say(f"Sending an example request ({EXAMPLE_IMAGE.name} + {EXAMPLE_PROMPT!r}) ...")
    with httpx.Client(trust_env=False, timeout=300.0) as http:
        client = OpenAI(base_url=f"{proxy_url}/v1", api_key="none", http_client=http)
        content = [
            {"type": "image_url", "image_url": {"url": example_data_url()}},
            {"type": "text", "text": EXAMPLE_PROMPT},
        ]
        try:
            reply = client.chat.completions.create(
                model=model_name,
                max_tokens=max_tokens,
                temperature=0,
                messages=[{"role": "user", "content": content}],
            )
        except Exception as e:  # the user sees why; launch still stops cleanly
            _say(f"example request failed: {type(e).__name__}: {e}")
            return False
    _say(f"Example reply: {reply.choices[0].message.content!r}")
    _say(
        f"(usage: {reply.usage.prompt_tokens} prompt + {reply.usage.completion_tokens} output tokens)"
    )
    return True


def _default_model() -> str:
    try:
        from epd.models import default_model_dir
    except ImportError:
        from epd.models.tiny import default_model_dir
    _say("epd launch: no --model given; using the embedded tiny llava checkpoint")
    return str(default_model_dir("llava"))


def _model_name(proxy_url: str, fallback: str) -> str:
    try:
        r = httpx.get(f"{proxy_url}/v1/models", timeout=10.0, trust_env=False)
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return fallback


class _Stop(Exception):
    pass


def _on_sigterm(signum, frame) -> None:
    raise _Stop


def run(args: argparse.Namespace) -> int:
    counts = ("encoders", "prefills", "decodes") if args.pd else ("encoders", "llms")
    if any(getattr(args, name) < 1 for name in counts):
        _say(f"epd launch: {', '.join('--' + n for n in counts)} must be at least 1")
        return 2
    model = args.model or _default_model()
    launcher = Launcher(args, model)
    launcher.plan()
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    code = 0
    try:
        if not launcher.start_all():
            return 1
        name = _model_name(launcher.proxy_url, Path(model).name)
        print_usage(launcher.proxy_url, name, args.max_tokens)
        if not args.no_example:
            ok = run_example(launcher.proxy_url, name, args.max_tokens)
            if args.exit_after_example:
                return 0 if ok else 1
        elif args.exit_after_example:
            return 0
        _say("Running; press Ctrl-C to stop.")
        while (dead := launcher.dead_child()) is None:
            time.sleep(0.5)
        launcher._report_failure(dead, f"exited with code {dead.proc.returncode}")
        code = 1
    except (KeyboardInterrupt, _Stop):
        _say("\nepd launch: stopping ...")
    finally:
        signal.signal(signal.SIGTERM, previous)
        launcher.stop_all()
        _say("epd launch: all processes stopped.")
    return code
