"""Release acks over ZMQ: consumers PUSH `Ack` JSON, the producer's `AckListener` PULLs.

- The listener binds the configured host only (port 0 -> a free port; `.address` is the
  `tcp://host:port` peers send to). Its daemon thread owns the socket, validates each
  message as an `Ack` (JSON only) and calls `on_ack`; invalid messages and exceptions in
  `on_ack` are logged and dropped, never fatal to the thread.
- `AckSender.send` never blocks the caller: messages queue in ZMQ (bounded by the high
  water mark) and are dropped with a warning when the queue is full. A lost ack is safe:
  the producer's lease expiry frees the blocks.
- Test hook: with the environment variable `EPD_TEST_DROP_ACKS=1` (read at each send),
  `AckSender.send` drops every ack, so lease-expiry paths can be tested end to end.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import zmq
from pydantic import ValidationError

from epd.transfer.messages import Ack

logger = logging.getLogger(__name__)

DROP_ACKS_ENV = "EPD_TEST_DROP_ACKS"
_POLL_MS = 100
_LINGER_MS = 1000
_SNDHWM = 10_000
_MAX_MSG_BYTES = 1 << 20


def _tcp_address(host: str, port: int | str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class AckListener:
    def __init__(self, host: str, port: int = 0, *, on_ack: Callable[[Ack], None]) -> None:
        self._on_ack = on_ack
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, _MAX_MSG_BYTES)
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.bind(_tcp_address(host, port if port else "*"))
        except zmq.ZMQError:
            sock.close()
            self._ctx.term()
            raise
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(endpoint.rsplit(":", 1)[1])
        self.address = _tcp_address(host, self.port)
        self.num_received = 0
        self.num_invalid = 0
        self._stop = threading.Event()
        self._sock = sock  # used only by the thread from here on
        self._thread = threading.Thread(target=self._run, name="epd-ack-listener", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sock = self._sock
        try:
            while not self._stop.is_set():
                if not sock.poll(_POLL_MS):
                    continue
                try:
                    raw = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                self._handle(raw)
        except Exception:  # a dead listener means leaked leases until expiry: say so loudly
            logger.exception("ack listener on %s stopped", self.address)
        finally:
            sock.close(linger=0)

    def _handle(self, raw: bytes) -> None:
        try:
            ack = Ack.model_validate_json(raw)
        except ValidationError as exc:
            self.num_invalid += 1
            logger.warning("dropping invalid ack on %s: %s", self.address, exc.errors()[:1])
            return
        self.num_received += 1
        try:
            self._on_ack(ack)
        except Exception:
            logger.exception("ack handler failed for %s", ack)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._ctx.term()

    def __enter__(self) -> AckListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AckSender:
    """One PUSH socket per destination address, created on first use; thread-safe."""

    def __init__(self) -> None:
        self._ctx = zmq.Context()
        self._socks: dict[str, zmq.Socket] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.num_dropped = 0

    def send(self, address: str, ack: Ack) -> None:
        if os.environ.get(DROP_ACKS_ENV) == "1":
            logger.debug("%s=1: dropping ack %s to %s", DROP_ACKS_ENV, ack.lease_ids, address)
            self.num_dropped += 1
            return
        payload = ack.model_dump_json().encode()
        with self._lock:
            if self._closed:
                raise RuntimeError("AckSender is closed")
            sock = self._socks.get(address)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, _LINGER_MS)
                sock.setsockopt(zmq.SNDHWM, _SNDHWM)
                if address.startswith("tcp://["):
                    sock.setsockopt(zmq.IPV6, 1)
                sock.connect(address)
                self._socks[address] = sock
            try:
                sock.send(payload, zmq.NOBLOCK)
            except zmq.Again:
                self.num_dropped += 1
                logger.warning(
                    "ack queue to %s is full; dropping ack for %s", address, ack.lease_ids
                )

    def close(self) -> None:
        """Close all sockets; queued acks get up to the linger time to go out."""
        with self._lock:
            self._closed = True
            socks, self._socks = list(self._socks.values()), {}
        for sock in socks:
            sock.close()
        self._ctx.term()

    def __enter__(self) -> AckSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
