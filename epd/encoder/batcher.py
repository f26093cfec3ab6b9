"""Batches encode jobs into vision forwards: one forward at a time, in a worker thread.

Jobs submitted while a forward runs, or within `window_s` of the first job waking the
batcher, go into the next forward (up to `max_batch_images`). `forward(jobs)` runs in a
worker thread and records per-job errors on the jobs; `finish(jobs)` then runs on the
event loop, which resolves the jobs' futures. The event loop never waits on the model.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from epd.encoder.metrics import EncoderMetrics

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class EncodeJob:
    image: Any  # an epd.models ImageInput
    entry: Any  # its pending MMEntry
    future: asyncio.Future  # resolved by `finish`
    error: BaseException | None = None


class Batcher:
    def __init__(
        self,
        forward: Callable[[list[EncodeJob]], None],
        finish: Callable[[list[EncodeJob]], None],
        *,
        max_batch_images: int,
        window_s: float,
        metrics: EncoderMetrics,
    ) -> None:
        self._forward = forward
        self._finish = finish
        self.max_batch_images = max_batch_images
        self.window_s = window_s
        self.metrics = metrics
        self.forwards = 0
        self._queue: deque[EncodeJob] = deque()
        self._work: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    @property
    def queued(self) -> int:
        return len(self._queue)

    def start(self) -> None:
        self._work = asyncio.Event()
        self._task = asyncio.create_task(self._loop(), name="encoder-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def submit(self, job: EncodeJob) -> None:
        assert self._work is not None, "Batcher.start() was not called"
        self._queue.append(job)
        self._work.set()

    async def _loop(self) -> None:
        assert self._work is not None
        while True:
            await self._work.wait()
            if self.window_s > 0:
                await asyncio.sleep(self.window_s)
            n = min(len(self._queue), self.max_batch_images)
            batch = [self._queue.popleft() for _ in range(n)]
            if not self._queue:
                self._work.clear()
            if batch:
                await self._run(batch)

    async def _run(self, batch: list[EncodeJob]) -> None:
        start = time.perf_counter()
        try:
            await asyncio.to_thread(self._forward, batch)
        except Exception as exc:  # the whole forward failed
            logger.exception("vision forward of %d images failed", len(batch))
            for job in batch:
                job.error = job.error or exc
        self.metrics.encode_latency.observe(time.perf_counter() - start)
        self.metrics.batch_size.observe(len(batch))
        self.forwards += 1
        self._finish(batch)
