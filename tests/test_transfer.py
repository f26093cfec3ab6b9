"""Transfer layer: block-op merging, validation, and real dlslime TCP reads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient

from epd.transfer import (
    ReadOp,
    TransferError,
    available_backends,
    create_transfer_engine,
    merge_block_ops,
)
from epd.transfer._selftest import pattern_bytes
from epd.transfer.http import http_handshake, make_transfer_router

BLOCK = 256


# -- merge_block_ops / ReadOp ------------------------------------------------------------
def test_merge_consecutive_runs_on_both_sides():
    ops = merge_block_ops([0, 1, 2, 7, 8], [4, 5, 6, 1, 2], 16)
    assert ops == [ReadOp(0, 64, 48), ReadOp(112, 16, 32)]


def test_merge_breaks_when_only_one_side_is_consecutive():
    assert merge_block_ops([0, 1, 2], [3, 5, 6], 10) == [ReadOp(0, 30, 10), ReadOp(10, 50, 20)]
    assert merge_block_ops([0, 2], [0, 1], 10) == [ReadOp(0, 0, 10), ReadOp(20, 10, 10)]
    # Descending runs are not contiguous byte ranges.
    assert merge_block_ops([5, 4], [5, 4], 10) == [ReadOp(50, 50, 10), ReadOp(40, 40, 10)]


def test_merge_bases_and_edge_cases():
    assert merge_block_ops([], [], 8) == []
    assert merge_block_ops([3], [9], 8, local_base=100, remote_base=1000) == [ReadOp(124, 1072, 8)]
    with pytest.raises(ValueError, match="length"):
        merge_block_ops([0, 1], [0], 8)
    with pytest.raises(ValueError, match="block_nbytes"):
        merge_block_ops([0], [0], 0)
    with pytest.raises(ValueError, match="negative"):
        merge_block_ops([-1], [0], 8)


def test_read_op_rejects_bad_values():
    with pytest.raises(ValueError):
        ReadOp(0, 0, 0)
    with pytest.raises(ValueError):
        ReadOp(-1, 0, 4)
    with pytest.raises(TypeError):
        ReadOp(0, 1.5, 4)  # type: ignore[arg-type]


# -- in-process producer/consumer ------------------------------------------------------------
@pytest.fixture
def pair():
    producer = create_transfer_engine("tcp", "127.0.0.1", engine_id="producer")
    consumer = create_transfer_engine("tcp", "127.0.0.1", engine_id="consumer")
    src = pattern_bytes(64 * BLOCK, seed=1).view(64, BLOCK)
    dst = torch.zeros(64, BLOCK, dtype=torch.uint8)
    producer.register_pool("pool", src)
    consumer.register_pool("pool", dst)
    consumer.connect("producer", lambda info: producer.accept("consumer", info))
    yield producer, consumer, src, dst
    consumer.close()
    producer.close()


def test_read_more_than_31_ops_is_split(pair):
    producer, consumer, src, dst = pair
    calls = []
    original = consumer._start_read

    def spy(endpoint, assign):
        calls.append(len(assign))
        return original(endpoint, assign)

    consumer._start_read = spy
    local_ids = list(range(0, 64, 2))[:32] + list(range(1, 17, 2))  # 40 non-adjacent blocks
    remote_ids = [63 - i for i in local_ids]
    ops = merge_block_ops(local_ids, remote_ids, BLOCK)
    assert len(ops) == 40
    fut = consumer.read("producer", "pool", "pool", ops)
    assert fut.wait(30) and fut.error is None
    assert calls == [31, 9]
    assert fut.nbytes == 40 * BLOCK
    for local, remote in zip(local_ids, remote_ids, strict=True):
        assert torch.equal(dst[local], src[remote])


def test_read_validates_ops_before_issuing(pair):
    producer, consumer, src, dst = pair
    issued = []
    consumer._start_read = lambda endpoint, assign: issued.append(assign)
    nbytes = 64 * BLOCK
    with pytest.raises(ValueError, match=r"ops\[1\] local range"):
        consumer.read("producer", "pool", "pool", [ReadOp(0, 0, 8), ReadOp(nbytes - 4, 0, 8)])
    with pytest.raises(ValueError, match=r"ops\[0\] remote range"):
        consumer.read("producer", "pool", "pool", [ReadOp(0, nbytes - 1, 2)])
    with pytest.raises(ValueError, match="no read ops"):
        consumer.read("producer", "pool", "pool", [])
    with pytest.raises(ValueError, match="unknown local pool"):
        consumer.read("producer", "kv", "pool", [ReadOp(0, 0, 8)])
    with pytest.raises(ValueError, match="has no pool"):
        consumer.read("producer", "pool", "kv", [ReadOp(0, 0, 8)])
    with pytest.raises(TransferError, match="not connected"):
        consumer.read("nobody", "pool", "pool", [ReadOp(0, 0, 8)])
    assert issued == []


def test_pool_registration_and_info(pair):
    producer, consumer, src, dst = pair
    with pytest.raises(ValueError, match="already registered"):
        producer.register_pool("pool", src)
    with pytest.raises(ValueError, match="contiguous"):
        producer.register_pool("t", src.t())
    info = json.loads(json.dumps(producer.local_info()))
    assert info["backend"] == "tcp" and info["engine_id"] == "producer"
    assert info["pools"]["pool"] == {
        "nbytes": 64 * BLOCK,
        "block_nbytes": BLOCK,
        "num_blocks": 64,
        "dtype": "uint8",
    }
    assert consumer.remote_pool_info("producer", "pool").num_blocks == 64


def test_accept_rejects_other_backend(pair):
    producer, _, _, _ = pair
    with pytest.raises(TransferError, match="backend"):
        producer.accept("x", {"backend": "rdma", "endpoint": {}})


def test_tcp_host_must_be_concrete():
    with pytest.raises(TransferError, match="wildcard"):
        create_transfer_engine("tcp", "0.0.0.0")


def test_registry():
    backends = available_backends()
    assert set(backends) == {"tcp", "rdma", "nvlink"}
    assert backends["tcp"] is None
    assert isinstance(backends["nvlink"], str)
    engine = create_transfer_engine("auto")
    try:
        expected = next(n for n in ("nvlink", "rdma", "tcp") if backends[n] is None)
        assert engine.name == expected
    finally:
        engine.close()
    with pytest.raises(ValueError, match="unknown transfer backend"):
        create_transfer_engine("carrier-pigeon")
    with pytest.raises(TransferError, match="nvlink"):
        create_transfer_engine("nvlink")


def test_router_rejects_backend_mismatch(pair):
    producer, _, _, _ = pair
    app = FastAPI()
    app.include_router(make_transfer_router(producer))
    client = TestClient(app)
    resp = client.post(
        "/v1/transfer/connect", json={"peer_id": "c", "backend": "rdma", "info": {"endpoint": {}}}
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "backend"
    resp = client.post("/v1/transfer/connect", json={"peer_id": "c", "backend": "tcp", "info": {}})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "info.endpoint"


# -- two processes ------------------------------------------------------------------------
def _stop(proc: subprocess.Popen) -> None:
    """SIGSTOP `proc` and wait until the kernel reports it stopped (delivery is async)."""
    os.kill(proc.pid, signal.SIGSTOP)
    for _ in range(500):
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError("producer did not stop")


@pytest.fixture(scope="module")
def producer_proc():
    """One producer process shared by the two-process tests (start-up dominates)."""
    nbytes, seed = 32 * BLOCK, 7
    proc = subprocess.Popen(
        [sys.executable, "-m", "epd.transfer._selftest", "--nbytes", str(nbytes),
         "--block-nbytes", str(BLOCK), "--seed", str(seed)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line, "producer exited before becoming ready"
        info = json.loads(line)
        yield proc, info, pattern_bytes(nbytes, seed).view(-1, BLOCK)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.mark.e2e
def test_two_process_read_and_connection_reuse(producer_proc):
    proc, info, expected = producer_proc
    consumer = create_transfer_engine("tcp", "127.0.0.1", engine_id="reader")
    dst = torch.zeros(16, BLOCK, dtype=torch.uint8)
    consumer.register_pool("pool", dst)
    handshakes = []
    http = http_handshake(info["url"], consumer.engine_id, timeout_s=10)

    def counting(payload: dict) -> dict:
        handshakes.append(payload)
        return http(payload)

    try:
        consumer.connect("enc", counting)
        assert consumer.is_connected("enc")
        local_ids, remote_ids = [3, 4, 5, 9, 0, 1], [10, 11, 12, 2, 31, 30]
        fut = consumer.read("enc", "pool", "pool", merge_block_ops(local_ids, remote_ids, BLOCK))
        assert fut.wait(30) and fut.ok
        for local, remote in zip(local_ids, remote_ids, strict=True):
            assert torch.equal(dst[local], expected[remote])
        untouched = [i for i in range(16) if i not in local_ids]
        assert not dst[untouched].any()

        consumer.connect("enc", counting)  # reused: no second handshake
        assert len(handshakes) == 1
        dst.zero_()
        fut = consumer.read("enc", "pool", "pool", [ReadOp(BLOCK + 5, 20 * BLOCK + 3, 300)])
        assert fut.wait(30) and fut.ok
        assert torch.equal(
            dst.view(-1)[BLOCK + 5 : BLOCK + 305], expected.view(-1)[20 * BLOCK + 3 :][:300]
        )

        consumer.disconnect("enc")
        assert not consumer.is_connected("enc")
        consumer.connect("enc", counting)
        assert len(handshakes) == 2
        fut = consumer.read("enc", "pool", "pool", [ReadOp(0, 0, 16 * BLOCK)])
        assert fut.wait(30) and fut.ok
        assert torch.equal(dst, expected[:16])
    finally:
        consumer.close()


@pytest.mark.e2e
def test_wait_deadline_and_teardown_with_stalled_producer(producer_proc):
    proc, info, expected = producer_proc
    consumer = create_transfer_engine("tcp", "127.0.0.1")
    dst = torch.zeros(32, BLOCK, dtype=torch.uint8)
    consumer.register_pool("pool", dst)
    try:
        consumer.connect("enc", http_handshake(info["url"], consumer.engine_id))
        _stop(proc)  # the kernel still accepts connections; nobody answers
        fut = consumer.read("enc", "pool", "pool", [ReadOp(0, 0, 8 * BLOCK)])
        assert fut.wait(0.2) is False
        assert fut.poll() is False and fut.error is None
        os.kill(proc.pid, signal.SIGCONT)
        assert fut.wait(30) and fut.ok
        assert torch.equal(dst[:8], expected[:8])

        _stop(proc)
        fut = consumer.read("enc", "pool", "pool", [ReadOp(8 * BLOCK, 8 * BLOCK, BLOCK)])
        assert fut.wait(0.1) is False
        consumer.disconnect("enc")  # stops the I/O thread: the destination is safe to reuse
        assert fut.poll() is True
        assert "disconnected" in fut.error
        os.kill(proc.pid, signal.SIGCONT)
    finally:
        consumer.close()
