"""Asynchronous front of the engine: a background step thread + per-request asyncio streams.

Invariants: only the engine thread touches the engine's state; requests and aborts
enter through a locked inbox drained at the start of every step; the thread sleeps on a
condition while there is no work, and the migrator's events (EPD migration done or
failed) notify that condition, so a finished transfer is applied at once; while
migrations are pending the sleep is bounded (deadlines, pool space), and so it is while a
prefill engine holds leased KV blocks (until the next lease expiry). An output carrying
an `exception` (a 400/502 from the EPD migration, before any token) is raised in the
request's stream, so the client gets an HTTP error. A stream whose consumer goes away (GeneratorExit /
CancelledError, e.g. a client disconnect) aborts its request, freeing its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from collections.abc import Sequence as Seq
from typing import Any

from epd.errors import EPDError
from epd.llm.config import EngineConfig
from epd.llm.engine import LLMEngine
from epd.llm.outputs import EngineStats, RequestOutput
from epd.llm.sampling_params import SamplingParams
from epd.llm.sequence import MMItem, Sequence

logger = logging.getLogger(__name__)
_PENDING_POLL_S = 0.05


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None) -> None:
        self.engine = engine or LLMEngine(config)
        self.config = config
        self._cond = threading.Condition()
        self._inbox: list[tuple[str, Sequence | str]] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stats = self.engine.stats()
        self.engine.idle_wait_s = 0.0  # the loop below sleeps on the condition instead
        self.engine.wakeup = self._wake

    @property
    def processor(self):
        return self.engine.processor

    @property
    def spec(self):
        return self.engine.spec

    @property
    def layout(self):
        return self.engine.layout

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_alive(self) -> bool:
        """The engine thread is running (false before start, after shutdown or a crash)."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="epd-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        for rid in list(self._streams):
            self._deliver(RequestOutput(rid, [], "", finished=True, finish_reason="abort",
                                        error="engine shut down"))

    def stats(self) -> EngineStats:
        return self._stats  # a snapshot taken by the engine thread after each step

    # -- requests --------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        sampling: SamplingParams | None = None,
        mm_items: Seq[MMItem] = (),
        prompt_param: str = "prompt",
        epd: Any = None,
        *,
        prefill_only: bool = False,
        migration: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        if self._thread is None or self._stopping:
            raise EPDError("the engine is not running", type="service_unavailable", status=503)
        if request_id in self._streams:
            raise EPDError(f"request id {request_id!r} is already in use", param="request_id")
        seq = self.engine.make_sequence(request_id, prompt_token_ids, sampling, mm_items,
                                        prompt_param, epd, prefill_only=prefill_only,
                                        migration=migration)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        self._submit("add", seq)
        finished = False
        try:
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._submit("abort", request_id)

    def abort(self, request_id: str) -> None:
        self._submit("abort", request_id)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _submit(self, op: str, arg: Sequence | str) -> None:
        with self._cond:
            self._inbox.append((op, arg))
            self._cond.notify()

    # -- engine thread ---------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not (self._stopping or self._inbox or engine.has_work()):
                    # Pending migrations: wake now and then for deadlines and pool space;
                    # handed-over KV blocks: wake when the next lease expires.
                    timeout = engine.idle_timeout_s(_PENDING_POLL_S)
                    self._cond.wait(timeout)
                    if timeout is not None:
                        break
                inbox, self._inbox = self._inbox, []
            if self._stopping:
                for rid in list(engine.scheduler.seqs):  # free everything on the way out
                    engine.abort(rid)
                engine.step()
                self._stats = engine.stats()
                engine.close()
                return
            for op, arg in inbox:
                if op == "add":
                    try:
                        engine.add_sequence(arg)
                    except Exception as exc:
                        self._deliver_error(arg.request_id, exc)
                else:
                    engine.abort(arg)
            try:
                outputs = engine.step()
            except Exception as exc:  # the engine must keep serving
                logger.exception("engine step failed")
                outputs = []
                for rid in list(engine.scheduler.seqs):
                    engine.abort(rid)
                    self._deliver_error(rid, exc)
            # Stats first: a consumer woken by an output must not see an older snapshot.
            self._stats = engine.stats()
            for out in outputs:
                if out.exception is not None:
                    self._deliver_error(out.request_id, out.exception)
                else:
                    self._deliver(out)

    def _deliver(self, item: RequestOutput) -> None:
        stream = self._streams.get(item.request_id)
        if stream is None:
            return
        loop, queue = stream
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed
            self._streams.pop(item.request_id, None)

    def _deliver_error(self, request_id: str, exc: Exception) -> None:
        if not isinstance(exc, EPDError):
            exc = EPDError(f"internal engine error: {type(exc).__name__}", type="internal_error",
                           status=500)
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, queue = stream
            try:
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            except RuntimeError:
                self._streams.pop(request_id, None)
