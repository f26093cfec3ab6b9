"""Release acks over ZMQ: roundtrip, invalid messages, the drop hook."""

from __future__ import annotations

import queue

import pytest
import zmq

from epd.transfer.acks import DROP_ACKS_ENV, AckListener, AckSender
from epd.transfer.messages import Ack


@pytest.fixture
def listener():
    received: queue.Queue[Ack] = queue.Queue()
    lis = AckListener("127.0.0.1", 0, on_ack=received.put)
    yield lis, received
    lis.close()


def _raw_push(address: str, payload: bytes) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(address)
    sock.send(payload)
    sock.close()
    ctx.term()


def test_roundtrip(listener):
    lis, received = listener
    assert lis.address.startswith("tcp://127.0.0.1:") and lis.port > 0
    with AckSender() as sender:
        first = Ack(kind="release", lease_ids=["a", "b"], consumer_id="llm-0")
        second = Ack(kind="release", lease_ids=["c"], consumer_id="llm-0", ok=False, detail="boom")
        sender.send(lis.address, first)
        sender.send(lis.address, second)
        assert received.get(timeout=10) == first
        assert received.get(timeout=10) == second
        assert len(sender._socks) == 1  # one cached PUSH socket per address
    assert lis.num_received == 2


def test_invalid_messages_are_dropped_and_listener_survives(listener):
    lis, received = listener
    _raw_push(lis.address, b"{not json")
    _raw_push(lis.address, b'{"kind": "grab", "lease_ids": [], "consumer_id": "x"}')
    _raw_push(lis.address, b"\xff\xfe")
    good = Ack(kind="release", lease_ids=["z"], consumer_id="llm-1")
    _raw_push(lis.address, good.model_dump_json().encode())
    assert received.get(timeout=10) == good  # pushes from one peer arrive in order
    assert lis.num_invalid == 3 and lis.alive
    assert received.empty()


def test_handler_exception_does_not_kill_listener():
    got: queue.Queue[Ack] = queue.Queue()

    def handler(ack: Ack) -> None:
        if ack.lease_ids == ["bad"]:
            raise RuntimeError("handler bug")
        got.put(ack)

    with AckListener("127.0.0.1", on_ack=handler) as lis, AckSender() as sender:
        sender.send(lis.address, Ack(kind="release", lease_ids=["bad"], consumer_id="c"))
        sender.send(lis.address, Ack(kind="release", lease_ids=["ok"], consumer_id="c"))
        assert got.get(timeout=10).lease_ids == ["ok"]
        assert lis.alive


def test_drop_hook(listener, monkeypatch):
    lis, received = listener
    with AckSender() as sender:
        monkeypatch.setenv(DROP_ACKS_ENV, "1")
        sender.send(lis.address, Ack(kind="release", lease_ids=["dropped"], consumer_id="c"))
        assert sender.num_dropped == 1
        monkeypatch.delenv(DROP_ACKS_ENV)
        sender.send(lis.address, Ack(kind="release", lease_ids=["kept"], consumer_id="c"))
        assert received.get(timeout=10).lease_ids == ["kept"]
    assert received.empty() and lis.num_received == 1


def test_listener_binds_given_port_and_rejects_busy_port(listener):
    lis, _ = listener
    with pytest.raises(zmq.ZMQError):
        AckListener("127.0.0.1", lis.port, on_ack=lambda ack: None)
