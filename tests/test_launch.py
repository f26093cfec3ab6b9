"""End-to-end: `epd launch` starts encoder + LLM + proxy, answers the example, stops all."""

from __future__ import annotations

import ast
import re
import socket
from pathlib import Path

import pytest
from helpers import free_port, run_cli

from epd.launch import EXAMPLE_PROMPT, example_data_url
from epd.models.reference import reference_generate

pytestmark = pytest.mark.e2e


def epd_processes_with(ports: list[int]) -> list[str]:
    """Command lines of live `epd.cli` processes that mention one of `ports`."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any("epd.cli" in a for a in args) and any(str(p) in args for p in ports):
            found.append(" ".join(args))
    return found


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_launch_runs_the_example_and_stops_everything(llava_dir):
    port = free_port()
    proc = run_cli(
        [
            "launch",
            "--model",
            llava_dir,
            "--port",
            port,
            "--exit-after-example",
            "--max-tokens",
            "6",
            "--extra-llm-args",
            "--num-blocks 32 --max-model-len 512",
        ],
        timeout_s=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"http://127.0.0.1:{port}/v1" in out
    assert "curl" in out and "from openai import OpenAI" in out
    reply = re.search(r"^Example reply: (.*)$", out, re.MULTILINE)
    assert reply is not None, out
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": example_data_url()}},
                {"type": "text", "text": EXAMPLE_PROMPT},
            ],
        }
    ]
    assert ast.literal_eval(reply.group(1)) == reference_generate(llava_dir, messages, 6).text
    ports = [int(p) for p in re.findall(r"started \S+\s+http://127\.0\.0\.1:(\d+)", out)]
    assert len(ports) == 3 and port in ports
    assert epd_processes_with(ports) == []
    assert not any(port_open(p) for p in ports)
    assert "all processes stopped" in out


def test_launch_pd_is_not_available_yet():
    proc = run_cli(["launch", "--pd", "--no-example"], timeout_s=60)
    assert proc.returncode == 2
    assert "not available yet" in proc.stdout
