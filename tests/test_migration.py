"""Block migration: the generic `BlockMigrator` over real dlslime TCP, and the LLM engine
serving EPD requests whose image features it pulls from a real in-process encoder
(`EncoderEngine` + its transfer pool + ZMQ ack listener).

Every generation is compared with transformers' greedy generate(); after every run the
KV cache and the LLM-side feature pool hold nothing and the encoder's leases are acked.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from epd.encoder.config import EncoderConfig
from epd.encoder.engine import EncoderEngine
from epd.errors import EPDError
from epd.llm.config import EngineConfig
from epd.llm.engine import LLMEngine
from epd.llm.migration import BlockMigrator, MigrationJob, check_encoder_results, epd_prompt
from epd.llm.migration.migrator import AckOnDone
from epd.llm.sampling_params import SamplingParams
from epd.models.reference import reference_generate
from epd.protocol import EncoderResult
from epd.statemachine import SeqStatus
from epd.transfer import AckListener, TransferError, create_transfer_engine
from epd.transfer._selftest import pattern_bytes

IMAGES = Path(__file__).resolve().parent.parent / "examples" / "images"
BLOCK = 64
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def drain(migrator: BlockMigrator, n_terminal: int, timeout_s: float = 20.0) -> list:
    events: list = []
    deadline = time.monotonic() + timeout_s
    while sum(e.kind != "issued" for e in events) < n_terminal:
        assert time.monotonic() < deadline, events
        events += migrator.events()
        time.sleep(0.005)
    return events


def job(job_id, local, remote, *, peer="producer", deadline_s=20.0, **kw) -> MigrationJob:
    return MigrationJob(job_id=job_id, peer_id=peer, peer_url="http://unused", local_pool="dst",
                        remote_pool="src", local_block_ids=local, remote_block_ids=remote,
                        block_nbytes=BLOCK, deadline=time.monotonic() + deadline_s, **kw)


# -- the generic migrator ------------------------------------------------------------------
@pytest.fixture
def pair():
    producer = create_transfer_engine("tcp", "127.0.0.1", engine_id="producer")
    consumer = create_transfer_engine("tcp", "127.0.0.1", engine_id="consumer")
    src = pattern_bytes(64 * BLOCK, seed=3).view(64, BLOCK)
    dst = torch.zeros(64, BLOCK, dtype=torch.uint8)
    producer.register_pool("src", src)
    consumer.register_pool("dst", dst)
    handshakes: list[str] = []

    def handshake(url, my_id, timeout_s):
        handshakes.append(my_id)
        return lambda info: producer.accept(my_id, info)

    migrator = BlockMigrator(consumer, handshake=handshake)
    yield migrator, producer, src, dst, handshakes
    migrator.close()
    consumer.close()
    producer.close()


def test_migrator_reads_exact_bytes_in_many_ops_then_acks(pair):
    migrator, _, src, dst, handshakes = pair
    acks = []
    listener = AckListener("127.0.0.1", on_ack=acks.append)
    try:
        local = list(range(0, 64, 2))[:32] + list(range(1, 17, 2))  # 40 runs: > 31 per call
        remote = [63 - i for i in local]
        ack = AckOnDone(listener.address, ("lease-a", "lease-b"))
        migrator.submit(job("j1", local, remote, ack=ack))
        events = drain(migrator, 1)
        assert [(e.job_id, e.kind) for e in events] == [("j1", "issued"), ("j1", "done")]
        assert events[1].nbytes == 40 * BLOCK
        for lo, re in zip(local, remote, strict=True):
            assert torch.equal(dst[lo], src[re])
        untouched = [i for i in range(64) if i not in local]
        assert not dst[untouched].any()
        assert wait_until(lambda: len(acks) == 1)
        assert acks[0].lease_ids == ["lease-a", "lease-b"] and acks[0].ok
        assert acks[0].consumer_id == "consumer"
        # The connection is reused: a second job needs no second handshake.
        migrator.submit(job("j2", [60, 61, 62], [0, 1, 2]))
        assert [e.kind for e in drain(migrator, 1)] == ["issued", "done"]
        assert torch.equal(dst[60:63], src[0:3]) and handshakes == ["consumer"]
        assert migrator.num_in_flight == 0 and migrator.num_done == 2
    finally:
        listener.close()


def test_migrator_checks_before_reading(pair):
    migrator, _, _, dst, _ = pair
    bad = EPDError("nope", param="x")
    seen = []
    migrator.submit(job("c", [0], [1], check=lambda pool: seen.append(pool) or bad))
    migrator.submit(job("r", [0, 1], [63, 64]))  # block 64 is past the remote pool
    no_pool = job("p", [0], [0])
    no_pool.remote_pool = "kv"  # the peer has no such pool
    migrator.submit(no_pool)
    by_id = {e.job_id: e for e in drain(migrator, 3)}
    assert by_id["c"].kind == "failed" and by_id["c"].error is bad
    assert seen[0].num_blocks == 64 and seen[0].block_nbytes == BLOCK
    assert by_id["r"].kind == "failed" and "outside pool" in str(by_id["r"].error)
    assert by_id["p"].kind == "failed" and "no pool 'kv'" in str(by_id["p"].error)
    assert not dst.any()  # nothing was issued


def test_migrator_fails_fast_when_the_peer_is_gone(pair):
    migrator, _, _, _, _ = pair

    def refused(url, my_id, timeout_s):
        def handshake(info):
            raise TransferError("connection refused")

        return handshake

    migrator._handshake = refused
    migrator.submit(job("gone", [0], [0], peer="dead"))
    (ev,) = drain(migrator, 1)
    assert ev.kind == "failed" and isinstance(ev.error, TransferError)


@pytest.fixture(scope="module")
def stalled_producer():
    """A producer process we can SIGSTOP: the kernel accepts, nobody answers."""
    nbytes = 64 * BLOCK
    proc = subprocess.Popen(
        [sys.executable, "-m", "epd.transfer._selftest", "--nbytes", str(nbytes),
         "--block-nbytes", str(BLOCK), "--seed", "5"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        info = json.loads(proc.stdout.readline())
        yield proc, info, pattern_bytes(nbytes, 5).view(-1, BLOCK)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_migrator_deadline_tears_down_before_reporting(stalled_producer):
    proc, info, expected = stalled_producer
    consumer = create_transfer_engine("tcp", "127.0.0.1", engine_id="late-reader")
    dst = torch.zeros(16, BLOCK, dtype=torch.uint8)
    consumer.register_pool("dst", dst)
    futures = []
    real_read = consumer.read

    def spy(*args):
        futures.append(real_read(*args))
        return futures[-1]

    consumer.read = spy
    handshakes = []

    def counting(url, my_id, timeout_s):
        handshakes.append(url)
        from epd.transfer import http_handshake

        return http_handshake(url, my_id, timeout_s)

    migrator = BlockMigrator(consumer, handshake=counting)

    def read(job_id, local, remote, deadline_s):
        migrator.submit(MigrationJob(job_id, info["engine_id"], info["url"], "dst", "pool",
                                     local, remote, BLOCK, time.monotonic() + deadline_s))
        return drain(migrator, 1)

    try:
        assert [e.kind for e in read("warm", [0], [1], 20)] == ["issued", "done"]
        os.kill(proc.pid, signal.SIGSTOP)
        events = read("late", [1, 2], [5, 6], 0.5)
        assert [e.kind for e in events] == ["issued", "failed"]
        assert isinstance(events[-1].error, TimeoutError)
        # `failed` came only after the endpoint was torn down: nothing writes into dst now
        assert futures[-1].poll() and "disconnected" in futures[-1].error
        assert not consumer.is_connected(info["engine_id"])
        os.kill(proc.pid, signal.SIGCONT)
        # The next job reconnects (fresh handshake) and reads the right bytes.
        assert [e.kind for e in read("again", [3], [9], 20)] == ["issued", "done"]
        assert torch.equal(dst[3], expected[9]) and torch.equal(dst[0], expected[1])
        assert len(handshakes) == 2
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        migrator.close()
        consumer.close()


# -- the engine serving EPD requests against an in-process encoder --------------------------
class InProcessEncoder:
    """A real `EncoderEngine` on its own event loop thread, its pool registered with a TCP
    transfer engine, and a ZMQ ack listener releasing leases (as `epd serve --role encoder`
    wires them). The LLM engine's handshake calls `accept` directly instead of over HTTP."""

    def __init__(self, model_dir: Path, block_tokens: int = 4, num_blocks: int = 96) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.config = EncoderConfig(model=str(model_dir), mm_block_tokens=block_tokens,
                                    mm_num_blocks=num_blocks, batch_window_ms=1.0)
        self.engine = EncoderEngine(self.config)
        self.run(self.engine.start())
        self.transfer = create_transfer_engine("tcp", "127.0.0.1",
                                               engine_id=self.config.encoder_id)
        self.transfer.register_pool(self.config.pool_name, self.engine.cache.tensor)
        self.acks = AckListener("127.0.0.1", on_ack=lambda ack: self.loop.call_soon_threadsafe(
            self.engine.release, list(ack.lease_ids)))
        self.handshakes = 0

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def handshake(self, url, my_id, timeout_s):
        self.handshakes += 1
        return lambda info: self.transfer.accept(my_id, info)

    def encode(self, names: list[str]) -> EncoderResult:
        pil = [Image.open(IMAGES / n).convert("RGB") for n in names]
        refs = self.run(self.engine.encode(pil))
        return EncoderResult(encoder_id=self.config.encoder_id, encoder_url="http://127.0.0.1:9",
                             transfer_backend="tcp", pool_name=self.config.pool_name,
                             ack_address=self.acks.address, images=refs)

    def stats(self) -> dict:
        async def get():
            return self.engine.stats()

        return self.run(get())

    def close(self) -> None:
        self.acks.close()
        self.run(self.engine.stop())
        self.transfer.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def image_names(messages: list[dict]) -> list[str]:
    return [Path(p["image_url"]["url"]).name for m in messages if isinstance(m["content"], list)
            for p in m["content"] if p["type"] == "image_url"]


def user(*parts: str) -> list[dict]:
    content = [{"type": "image_url", "image_url": {"url": str(IMAGES / p)}}
               if (IMAGES / p).is_file() else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


CONVERSATIONS = [
    user("cat.png", "What is in the picture?"),
    user("Describe this:", "sunset.png"),
    user("bar_chart.jpg", "city_street.jpg", "Compare the two images."),
    user("spiral.webp", "first", "cat.png", "sunset.png"),
    user("cat.png", "Is it an animal?"),
    user("city_street.jpg", "Where is this?"),
    user("sunset.png", "spiral.webp", "Which is warmer?"),
    user("bar_chart.jpg", "Read the chart."),
]
_REFS: dict[int, list[int]] = {}


def reference(model_dir: Path, i: int) -> list[int]:
    if i not in _REFS:
        _REFS[i] = reference_generate(model_dir, CONVERSATIONS[i], MAX_TOKENS).token_ids
    return _REFS[i]


@pytest.fixture(scope="module")
def encoder(llava_dir):
    enc = InProcessEncoder(llava_dir)
    yield enc
    enc.close()


def make_engine(model_dir: Path, encoder: InProcessEncoder, **kw) -> LLMEngine:
    fields = dict(model_dir=model_dir, block_size=4, num_blocks=128, vision="none",
                  transfer="tcp", mm_block_tokens=3, mm_num_blocks=64)
    engine = LLMEngine(EngineConfig(**{**fields, **kw}))
    engine.epd.handshake = encoder.handshake
    return engine


def add_epd(engine: LLMEngine, rid: str, messages: list[dict], result: EncoderResult):
    epd = check_encoder_results(
        [result], listed=False, hidden_size=engine.spec.hidden_size, dtype="float32",
        image_tokens=16, mm_block_tokens=engine.epd.config.mm_block_tokens,
        mm_num_blocks=engine.epd.num_blocks)
    ids, items = epd_prompt(engine.processor, messages, epd)
    return engine.add_request(rid, ids, GREEDY, items, "messages", epd)


def run(engine: LLMEngine, timeout_s: float = 60.0) -> dict:
    outs: dict = {}
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished():
        assert time.monotonic() < deadline
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def assert_all_released(engine: LLMEngine, encoder: InProcessEncoder, leases_before: int):
    engine.blocks.check_integrity()
    engine.epd.cache.check_integrity()
    s = engine.stats()
    assert s.kv_blocks_free == s.kv_blocks_total and s.num_migrating == 0
    assert s.mm_blocks_referenced == 0 and s.mm_blocks_free == s.mm_blocks_total
    assert engine.epd.migrator.num_in_flight == 0
    assert wait_until(lambda: encoder.stats()["leases"] == leases_before)
    encoder.engine.check_integrity()
    assert encoder.stats()["blocks_referenced"] == 0


def test_epd_batch_with_preemption_matches_reference(llava_dir, encoder):
    engine = make_engine(llava_dir, encoder, num_blocks=26, max_num_batched_tokens=64)
    try:
        before = encoder.stats()["leases"]
        seqs = [add_epd(engine, f"r{i}", conv, encoder.encode(image_names(conv)))
                for i, conv in enumerate(CONVERSATIONS)]
        assert all(s.status is SeqStatus.WAITING_EPD_MIGRATION for s in seqs)
        outs = run(engine)
        for i, seq in enumerate(seqs):
            assert seq.output_token_ids == reference(llava_dir, i), f"conversation {i}"
            final = outs[f"r{i}"][-1]
            assert final.finished and final.timings["epd_migration"] > 0
            statuses = [s for s, _ in seq.status_history]
            assert statuses[:4] == [SeqStatus.WAITING_EPD_MIGRATION,
                                    SeqStatus.RUNNING_EPD_MIGRATION,
                                    SeqStatus.EPD_MIGRATION_LOCKED, SeqStatus.WAITING]
        stats = engine.stats()
        assert stats.num_preemptions > 0 and stats.epd_migrations == len(CONVERSATIONS)
        # 5 distinct images: each read once; the rest were resident or in flight already
        assert engine.epd.counts["reads"] <= 5 + len(CONVERSATIONS)
        assert engine.epd.cache.num_entries == 5 and encoder.handshakes >= 1
        assert_all_released(engine, encoder, before)
        # Resident features: no read at all, the lease is still acked, prefix cache hits.
        reads = engine.epd.counts["reads"]
        seq = add_epd(engine, "again", CONVERSATIONS[0], encoder.encode(["cat.png"]))
        run(engine)
        assert seq.output_token_ids == reference(llava_dir, 0)
        assert engine.epd.counts["reads"] == reads and seq.num_cached_tokens > 0
        assert_all_released(engine, encoder, before)
    finally:
        engine.close()


def test_epd_bad_block_ids_fail_with_400_and_free_everything(llava_dir, encoder):
    engine = make_engine(llava_dir, encoder)
    try:
        before = encoder.stats()["leases"]
        good = encoder.encode(["cat.png"])
        bad = good.model_copy(deep=True)
        bad.images[0].block_ids[-1] = 10_000
        seq = add_epd(engine, "bad", CONVERSATIONS[0], bad)
        outs = run(engine)
        (out,) = outs["bad"]
        assert out.finished and out.finish_reason == "error" and seq.status is SeqStatus.ENDED
        assert out.exception.status == 400
        assert out.exception.param == "encoder_result.images[0].block_ids"
        # nothing was acked: the lease is the proxy's (or expiry's) to end
        assert encoder.stats()["leases"] == before + 1
        encoder.run(asyncio.sleep(0))
        encoder.loop.call_soon_threadsafe(encoder.engine.release, good.lease_ids)
        assert_all_released(engine, encoder, before)
    finally:
        engine.close()


def test_epd_dead_encoder_fails_with_502_and_keeps_serving(llava_dir, encoder):
    engine = make_engine(llava_dir, encoder, migration_timeout_s=2.0)
    try:
        before = encoder.stats()["leases"]
        result = encoder.encode(["sunset.png"])
        ghost = result.model_copy(update={"encoder_id": "ghost-encoder"})

        def refused(url, my_id, timeout_s):
            def handshake(info):
                raise TransferError("connection refused")

            return handshake

        engine.epd.handshake = refused  # before the migrator exists: used for every peer
        add_epd(engine, "dead", CONVERSATIONS[1], ghost)
        (out,) = run(engine)["dead"]
        assert out.exception.status == 502 and out.exception.code == "epd_migration"
        assert "epd_migration" in out.exception.message
        assert engine.stats().mm_blocks_referenced == 0
        engine.epd.migrator._handshake = encoder.handshake  # the encoder is back
        seq = add_epd(engine, "alive", CONVERSATIONS[1], result)
        run(engine)
        assert seq.output_token_ids == reference(llava_dir, 1)
        assert_all_released(engine, encoder, before)
    finally:
        engine.close()


def test_epd_abort_during_migration_frees_after_the_read(llava_dir, encoder):
    engine = make_engine(llava_dir, encoder)
    try:
        before = encoder.stats()["leases"]
        conv = CONVERSATIONS[2]
        seq = add_epd(engine, "gone", conv, encoder.encode(image_names(conv)))
        engine.step()  # allocates the feature blocks and submits the read
        assert seq.status in (SeqStatus.RUNNING_EPD_MIGRATION, SeqStatus.EPD_MIGRATION_LOCKED,
                              SeqStatus.WAITING, SeqStatus.RUNNING)
        assert engine.abort("gone") and seq.status is SeqStatus.ENDED
        cache = engine.epd.cache
        if engine.epd._jobs:  # read still in flight: its blocks stay allocated, held by the job
            assert cache.num_used_blocks == 2 * -(-16 // cache.block_tokens)
            assert cache.num_referenced_blocks == cache.num_used_blocks
        assert wait_until(lambda: not engine.step() and not engine.epd.busy)
        # the read itself succeeded: its features stay cached and the leases are acked
        assert cache.num_entries == 2 or engine.epd.counts["reads"] == 0
        assert_all_released(engine, encoder, before)
    finally:
        engine.close()


def test_epd_fastvlm_matches_reference(fastvlm_dir):
    encoder = InProcessEncoder(fastvlm_dir, block_tokens=5)
    engine = make_engine(fastvlm_dir, encoder, mm_block_tokens=16)
    try:
        conv = CONVERSATIONS[3]
        seq = add_epd(engine, "f", conv, encoder.encode(image_names(conv)))
        run(engine)
        ref = reference_generate(fastvlm_dir, conv, MAX_TOKENS).token_ids
        assert seq.output_token_ids == ref
        assert_all_released(engine, encoder, 0)
    finally:
        engine.close()
        encoder.close()
