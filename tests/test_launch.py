"""`epd launch`: the process plan (unit), and end-to-end: it starts encoder + LLM + proxy
(or encoder + prefill + decode + proxy with --pd), answers the example, stops everything."""

from __future__ import annotations

import argparse
import ast
import re
import socket
from pathlib import Path

import pytest
from helpers import free_port, run_cli

from epd.launch import EXAMPLE_PROMPT, Launcher, add_arguments, example_data_url
from epd.models.reference import reference_generate


def plan(*argv: str) -> dict[str, list[str]]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "/m", "--port", "9000", "--base-port", "9100", *argv])
    launcher = Launcher(args, "/m")
    launcher.plan()
    return {c.name: c.cmd for c in launcher.children}


def test_plan_colocated_and_pd(tmp_path):
    cmds = plan("--log-dir", str(tmp_path))
    assert list(cmds) == ["encoder0", "llm0", "proxy"]
    assert cmds["llm0"][cmds["llm0"].index("--role") + 1] == "llm"
    proxy = " ".join(cmds["proxy"])
    assert "--encoder http://127.0.0.1:9100 --llm http://127.0.0.1:9101" in proxy
    assert "--mode" not in proxy
    cmds = plan(
        "--log-dir", str(tmp_path), "--pd", "--decodes", "2",
        "--extra-prefill-args", "--num-blocks 8", "--extra-decode-args", "--num-blocks 64",
    )  # fmt: skip
    assert list(cmds) == ["encoder0", "prefill0", "decode0", "decode1", "proxy"]
    assert cmds["prefill0"][-2:] == ["--num-blocks", "8"]
    assert cmds["decode1"][-2:] == ["--num-blocks", "64"]
    assert cmds["decode1"][cmds["decode1"].index("--role") + 1] == "decode"
    proxy = " ".join(cmds["proxy"])
    assert "--mode pd" in proxy and "--prefill http://127.0.0.1:9101" in proxy
    assert "--decode http://127.0.0.1:9102 --decode http://127.0.0.1:9103" in proxy


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


@pytest.mark.e2e
@pytest.mark.parametrize("pd", [False, True], ids=["colocated", "pd"])
def test_launch_runs_the_example_and_stops_everything(llava_dir, pd):
    port = free_port()
    kv = "--num-blocks 32 --max-model-len 512"
    mode = ["--pd", "--extra-prefill-args", kv, "--extra-decode-args", kv] if pd else []
    args = ["launch", "--model", llava_dir, "--port", port, "--exit-after-example"]
    proc = run_cli(
        [*args, "--max-tokens", "6", "--extra-llm-args", kv, *mode],
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
    started = re.findall(r"started (\S+)\s+http://127\.0\.0\.1:(\d+)", out)
    names = [name for name, _ in started]
    assert names == (
        ["encoder0", "prefill0", "decode0", "proxy"] if pd else ["encoder0", "llm0", "proxy"]
    )
    ports = [int(p) for _, p in started]
    assert port in ports
    assert epd_processes_with(ports) == []
    assert not any(port_open(p) for p in ports)
    assert "all processes stopped" in out
