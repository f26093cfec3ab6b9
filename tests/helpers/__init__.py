"""Shared helpers for end-to-end tests: real `epd` subprocesses on free loopback ports.

`ServerProcess` starts `python -m epd.cli ARGS --host 127.0.0.1 --port N`, waits for
`GET /health` to answer 200, writes the process output to a log file and prints its tail
when startup fails, when the `with` body raises or when the process died on its own. The
process is always stopped on exit (SIGTERM to its process group, SIGKILL after a grace
period), so a failing test never leaves a server behind.

Usage (tests import it as `from helpers import ServerProcess, free_port`):

    with ServerProcess(["serve", "--role", "llm", "--model", str(model_dir)]) as srv:
        httpx.get(f"{srv.url}/health")
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_IMAGES = REPO_ROOT / "examples" / "images"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_http_ok(url: str, timeout_s: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    """Poll `url` until it answers 200; fail early if `proc` exits."""
    deadline = time.monotonic() + timeout_s
    last: str = "no answer"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with code {proc.returncode} before {url} was up")
        try:
            r = httpx.get(url, timeout=2.0)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f}s ({last})")


class ServerProcess:
    """A real `epd` server subprocess (`epd serve ...`, `epd proxy ...`) on loopback."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        env: Mapping[str, str] | None = None,
        startup_timeout_s: float = 120.0,
        health_path: str = "/health",
        log_dir: str | Path | None = None,
        name: str | None = None,
    ) -> None:
        self.args = [str(a) for a in args]
        self.host = host
        self.port = port or free_port(host)
        self.health_path = health_path
        self.startup_timeout_s = startup_timeout_s
        self.name = name or "-".join(self.args[:3]).replace("--", "")
        log_root = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="epd-e2e-"))
        self.log_path = log_root / f"{self.name}-{self.port}.log"
        self.env = dict(os.environ)
        # Tests share 2 cores with other test processes; keep servers single-threaded.
        self.env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"})
        self.env.update(env or {})
        self.proc: subprocess.Popen | None = None
        self._log_file = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "epd.cli", *self.args]
        if "--host" not in self.args:
            cmd += ["--host", self.host]
        if "--port" not in self.args:
            cmd += ["--port", str(self.port)]
        return cmd

    def start(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "wb")  # closed in stop()
        self.proc = subprocess.Popen(
            self.command(),
            cwd=REPO_ROOT,
            env=self.env,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() reaches its children
        )
        try:
            wait_http_ok(self.url + self.health_path, self.startup_timeout_s, self.proc)
        except BaseException:
            self.print_logs("failed to start")
            self.stop()
            raise
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def logs(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def print_logs(self, why: str, tail_chars: int = 20000) -> None:
        text = self.logs()
        print(f"\n===== {self.name} ({' '.join(self.command())}) {why}; log {self.log_path} =====")
        print(text[-tail_chars:])
        print(f"===== end of {self.name} log =====", flush=True)

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM the process group, SIGKILL after `grace_s`; returns the exit code."""
        proc, self.proc = self.proc, None
        code = None
        if proc is not None:
            if proc.poll() is None:
                self._signal(proc, signal.SIGTERM)
                try:
                    proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    self._signal(proc, signal.SIGKILL)
                    proc.wait(10)
            code = proc.returncode
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return code

    @staticmethod
    def _signal(proc: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        died = self.proc is not None and self.proc.poll() is not None
        self.stop()
        if exc_type is not None or died:
            self.print_logs("exited unexpectedly" if died else f"test raised {exc_type.__name__}")


def run_cli(args: Sequence[str], timeout_s: float = 120.0, env: Mapping[str, str] | None = None):
    """Run `python -m epd.cli ARGS` to completion; returns the CompletedProcess (text)."""
    full_env = dict(os.environ)
    full_env.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "epd.cli", *map(str, args)],
        cwd=REPO_ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
