"""The encoder engine: images -> vision features in the paged multimodal cache, leased out.

Invariants:
- Only the vision tower + projector are loaded (`load_vision_model`), never the LM.
- Content-addressed: an image is keyed by its `mm_hash`; a ready entry is served from the
  cache, and concurrent requests for the same new image share one encode (single flight:
  `_inflight[mm_hash]` is a future resolved by the batcher; all bookkeeping of
  `_inflight` and the queue happens on the event loop thread, so check-then-allocate is
  atomic). Every pending cache entry has exactly one in-flight future.
- Batching: jobs queue up while a forward runs or during `batch_window_ms`, and up to
  `max_batch_images` go through one `VisionModel.encode` in a worker thread; one forward at
  a time, the event loop never blocks on the model.
- Refs: each image handed out holds one cache ref under one lease; the ref is dropped
  exactly once, by `release` (ack / explicit release, idempotent) or by lease expiry. A
  request that fails or is cancelled releases every ref it took, so no block leaks.
- Everything but the vision forward runs on the event loop thread.
- A full pool (nothing evictable) makes a request wait up to `alloc_timeout_seconds` for
  space, then it fails with 503 + Retry-After.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from epd.encoder import cache_setup
from epd.encoder.batcher import Batcher, EncodeJob
from epd.encoder.config import EncoderConfig
from epd.encoder.metrics import EncoderMetrics
from epd.errors import EPDError, internal_error, invalid_request, service_unavailable
from epd.mmcache import LeaseTable, MMCache, MMEntry
from epd.protocol import ImageFeatureRef

logger = logging.getLogger(__name__)

_SPACE_POLL_S = 0.1  # re-check for space at least this often while waiting


class EncoderEngine:
    def __init__(
        self,
        config: EncoderConfig,
        *,
        vision_model: Any = None,
        processor: Any = None,
        spec: Any = None,
    ) -> None:
        if spec is None or processor is None or vision_model is None:
            from epd.models import MultimodalProcessor, load_spec, load_vision_model

            spec = spec or load_spec(config.model)
            processor = processor or MultimodalProcessor.from_pretrained(config.model)
        self.config = config
        self.dtype = cache_setup.resolve_dtype(config.dtype, spec)
        self.hidden_size = int(spec.hidden_size)
        self.processor = processor
        self.vision = vision_model or load_vision_model(
            config.model, dtype=self.dtype, device=config.device
        )
        self.cache: MMCache = cache_setup.make_cache(config, self.hidden_size, self.dtype)
        self.leases: LeaseTable[MMEntry] = LeaseTable()
        self.metrics = EncoderMetrics()
        self.metrics.bind_gauges(
            blocks_used=lambda: self.cache.num_used_blocks,
            blocks_free=lambda: self.cache.num_free_blocks,
            blocks_referenced=lambda: self.cache.num_referenced_blocks,
            leases_active=lambda: len(self.leases),
        )
        self.counts = dict.fromkeys(
            ("hits", "misses", "encodes", "leases_released", "leases_expired", "alloc_timeouts"), 0
        )
        self.batcher = Batcher(
            self._forward, self._finish, max_batch_images=config.max_batch_images,
            window_s=config.batch_window_s, metrics=self.metrics,
        )  # fmt: skip
        self._inflight: dict[str, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._space: asyncio.Event | None = None
        self._sweeper: asyncio.Task | None = None
        cache_setup.log_sizes(config, self.vision, self.cache)

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._space = asyncio.Event()
        self.batcher.start()
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="encoder-lease-sweep")

    async def stop(self) -> None:
        await self.batcher.stop()
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None

    # -- encoding --------------------------------------------------------------------

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    async def encode(
        self, images: Sequence[Any], params: Sequence[str] | None = None, holder: str = ""
    ) -> list[ImageFeatureRef]:
        """PIL images -> one leased `ImageFeatureRef` per image, in order."""
        params = (
            list(params) if params is not None else [f"content[{i}]" for i in range(len(images))]
        )
        inputs = await asyncio.to_thread(self._preprocess, list(images), params)
        return await self.encode_inputs(inputs, params, holder)

    def _preprocess(self, images: list[Any], params: list[str]) -> list[Any]:
        out = []
        for image, param in zip(images, params, strict=True):
            try:
                out.append(self.processor.preprocess_images([image])[0])
            except Exception as exc:
                logger.info("preprocessing %s failed: %r", param, exc)
                raise invalid_request(
                    f"the image could not be preprocessed: {exc}", param
                ) from None
        return out

    async def encode_inputs(
        self, inputs: Sequence[Any], params: Sequence[str], holder: str = ""
    ) -> list[ImageFeatureRef]:
        """Preprocessed `ImageInput`s -> leased refs. All-or-nothing: on any failure or
        cancellation every ref taken for this request is released."""
        if self._loop is None:
            raise RuntimeError("EncoderEngine.start() was not called")
        if not inputs:
            return []
        for inp, param in zip(inputs, params, strict=True):
            need = self.cache.blocks_needed(inp.num_tokens)
            if need > self.cache.num_blocks:
                raise invalid_request(
                    f"the image needs {need} feature blocks but the encoder cache has only "
                    f"{self.cache.num_blocks}",
                    param,
                    code="image_too_large_for_cache",
                )
        tasks = [
            asyncio.ensure_future(self._acquire(inp, p))
            for inp, p in zip(inputs, params, strict=True)
        ]
        try:
            await asyncio.wait(tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._release_entries(
                t.result() for t in tasks if not t.cancelled() and t.exception() is None
            )
            raise
        errors = [t.exception() for t in tasks if t.exception() is not None]
        entries = [t.result() for t in tasks if t.exception() is None]
        if errors:
            self._release_entries(entries)
            raise next((e for e in errors if isinstance(e, EPDError)), errors[0])
        return [self._lease(entry, holder) for entry in entries]

    def _lease(self, entry: MMEntry, holder: str) -> ImageFeatureRef:
        lease = self.leases.grant(entry, self.config.lease_seconds, holder)
        return ImageFeatureRef(
            mm_hash=entry.mm_hash, num_tokens=entry.num_tokens, block_ids=list(entry.block_ids),
            block_tokens=self.cache.block_tokens, dtype=self.dtype_name,
            hidden_size=self.hidden_size, grid_thw=None, lease_id=lease.lease_id,
            lease_expires_at=lease.expires_at,
        )  # fmt: skip

    async def _acquire(self, inp: Any, param: str) -> MMEntry:
        """A ready cache entry for `inp` with one ref taken (encoding it if needed)."""
        assert self._loop is not None and self._space is not None
        deadline: float | None = None
        while True:
            flight = self._inflight.get(inp.mm_hash)
            if flight is not None:
                await asyncio.shield(flight)  # raises if that encode failed
                continue
            got = self.cache.get_or_allocate(inp.mm_hash, inp.num_tokens)
            if got is None:
                deadline = deadline or self._loop.time() + self.config.alloc_timeout_seconds
                await self._wait_for_space(deadline, param)
                continue
            entry, created = got
            if not created:
                assert entry.ready, "a pending entry without an in-flight encode"
                self._count_hit()
                return entry
            return await self._encode_new(inp, entry)

    async def _encode_new(self, inp: Any, entry: MMEntry) -> MMEntry:
        assert self._loop is not None
        self.counts["misses"] += 1
        self.metrics.cache_misses.inc()
        future = self._loop.create_future()
        self._inflight[inp.mm_hash] = future
        self.batcher.submit(EncodeJob(inp, entry, future))
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            # The batcher still finishes this job; hand our ref back once it does.
            future.add_done_callback(
                lambda f: f.cancelled() or f.exception() or self._release_entries([entry])
            )
            raise
        return entry

    def _count_hit(self) -> None:
        self.counts["hits"] += 1
        self.metrics.cache_hits.inc()

    async def _wait_for_space(self, deadline: float, param: str) -> None:
        assert self._loop is not None and self._space is not None
        remaining = deadline - self._loop.time()
        if remaining <= 0:
            self.counts["alloc_timeouts"] += 1
            self.metrics.alloc_timeouts.inc()
            raise service_unavailable(
                f"the encoder cache is full (all {self.cache.num_blocks} blocks are leased); "
                f"no space freed within {self.config.alloc_timeout_seconds:g} s for {param}",
                retry_after_s=max(1.0, self.config.alloc_timeout_seconds),
            )
        self._space.clear()
        try:
            await asyncio.wait_for(self._space.wait(), min(remaining, _SPACE_POLL_S))
        except asyncio.TimeoutError:
            pass

    # -- the batcher's callbacks -----------------------------------------------------

    def _finish(self, batch: list[EncodeJob]) -> None:
        """Event loop: resolve each job in the same tick as removing its flight, so a
        waiter that wakes finds a ready entry or no entry (failed: it gets the error)."""
        for job in batch:
            self._inflight.pop(job.image.mm_hash, None)
            if job.error is None:
                self.counts["encodes"] += 1
                self.metrics.images_encoded.inc()
                job.future.set_result(None)
            else:
                self.cache.drop(job.entry)
                self._notify_space()
                name = type(job.error).__name__
                job.future.set_exception(internal_error(f"encoding the image failed ({name})"))
                job.future.add_done_callback(lambda f: f.exception())  # mark retrieved

    def _forward(self, batch: list[EncodeJob]) -> None:
        """Worker thread: one vision forward, then the rows into each job's blocks."""
        with torch.inference_mode():
            features = self.vision.encode([job.image for job in batch])
        if len(features) != len(batch):
            raise RuntimeError(f"vision model returned {len(features)} results for {len(batch)}")
        for job, feats in zip(batch, features, strict=True):
            try:
                self.cache.commit(job.entry, feats.to(self.cache.dtype))
            except Exception as exc:
                logger.exception("writing features of %s failed", job.image.mm_hash)
                job.error = exc

    # -- releases and leases ---------------------------------------------------------

    def release(self, lease_ids: Iterable[str]) -> int:
        """End these leases (ack or explicit release); unknown/ended ids are ignored.
        Call on the event loop thread (the server hops ZMQ acks onto it). Returns how
        many leases ended now."""
        entries = [e for e in (self.leases.release(lid) for lid in lease_ids) if e is not None]
        self._release_entries(entries)
        self.counts["leases_released"] += len(entries)
        self.metrics.leases_released.inc(len(entries))
        return len(entries)

    def expire_leases(self, now: float | None = None) -> int:
        expired = self.leases.expire(now)
        if expired:
            logger.info("%d lease(s) expired without an ack; their refs are released", len(expired))
        self._release_entries(lease.payload for lease in expired)
        self.counts["leases_expired"] += len(expired)
        self.metrics.leases_expired.inc(len(expired))
        return len(expired)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.lease_sweep_interval_s)
            self.expire_leases()

    def _release_entries(self, entries: Iterable[MMEntry]) -> None:
        released = False
        for entry in entries:
            self.cache.release(entry)
            released = True
        if released:
            self._notify_space()

    def _notify_space(self) -> None:
        loop, space = self._loop, self._space
        if loop is None or space is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            space.set()
        else:
            loop.call_soon_threadsafe(space.set)

    # -- introspection ---------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {
            **cache_setup.cache_stats(self.cache),
            "leases": len(self.leases),
            "queued": self.batcher.queued,
            "forwards": self.batcher.forwards,
            "inflight": len(self._inflight),
            **self.counts,
        }

    def check_integrity(self) -> None:
        """The cache is consistent and, when no encode is queued or in flight, exactly the
        leased entries hold refs (one per lease)."""
        self.cache.check_integrity()
        if not self._inflight and not self.batcher.queued:
            cache_setup.check_leased_refs(self.cache, self.leases)
