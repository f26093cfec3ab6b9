"""Prefill-decode disaggregation inside the LLM engine: a prefill-role and a decode-role
`LLMEngine` in one process, with real dlslime TCP between them (the decode engine's
handshake calls the prefill's `accept` directly) and real ZMQ acks.

Every generation equals transformers' greedy generate(); afterwards both KV caches are
intact and back to their free-block counts, and the prefill's leases are all ended.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from PIL import Image

from epd.errors import EPDError
from epd.llm.config import EngineConfig
from epd.llm.engine import LLMEngine
from epd.llm.pd import decode_prompt
from epd.llm.sampling_params import SamplingParams
from epd.llm.sequence import MMItem
from epd.models.reference import reference_generate
from epd.protocol import MigrationRequest
from epd.statemachine import SeqStatus
from epd.transfer import TransferError

IMAGES = Path(__file__).resolve().parent.parent / "examples" / "images"
MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
P_BLOCKS, D_BLOCKS = 40, 96
TEXT = [{"role": "user", "content": "Tell me about the sea and the harbour at night."}]
IMAGE = [{"role": "user", "content": [{"type": "image_url",
                                       "image_url": {"url": str(IMAGES / "cat.png")}},
                                      {"type": "text", "text": "What is in the picture?"}]}]
_REFS: dict[int, list[int]] = {}


def reference(model_dir: Path, messages: list[dict]) -> list[int]:
    if id(messages) not in _REFS:
        _REFS[id(messages)] = reference_generate(model_dir, messages, MAX_TOKENS).token_ids
    return _REFS[id(messages)]


def wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def make(model_dir: Path, role: str, **kw) -> LLMEngine:
    fields = dict(model_dir=model_dir, block_size=4, num_blocks=D_BLOCKS, vision="none",
                  transfer="tcp", role=role, lease_seconds=30.0, migration_timeout_s=10.0)
    return LLMEngine(EngineConfig(**{**fields, **kw}))


def connect(decode: LLMEngine, prefill: LLMEngine) -> None:
    decode.hub.set_handshake(
        lambda url, my_id, timeout_s: lambda info: prefill.hub.transfer.accept(my_id, info))


@pytest.fixture(scope="module")
def prefill(llava_dir):
    engine = make(llava_dir, "prefill", num_blocks=P_BLOCKS, vision="local")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def decode(llava_dir, prefill):
    engine = make(llava_dir, "decode")
    connect(engine, prefill)
    yield engine
    engine.close()


def run(engine: LLMEngine, timeout_s: float = 60.0) -> dict:
    outs: dict = {}
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished():
        assert time.monotonic() < deadline
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def chat_prompt(engine: LLMEngine, messages: list[dict]) -> tuple[list[int], list[MMItem]]:
    proc = engine.processor
    names = [p["image_url"]["url"] for m in messages if isinstance(m["content"], list)
             for p in m["content"] if p["type"] == "image_url"]
    images = proc.preprocess_images([Image.open(n).convert("RGB") for n in names])
    prompt = proc.tokenize(proc.render(messages), images)
    items = [MMItem(s.offset, s.length, img.mm_hash, image=img)
             for s, img in zip(prompt.mm_spans, images, strict=True)]
    return list(prompt.token_ids), items


def do_prefill(prefill: LLMEngine, rid: str, messages: list[dict],
               sampling: SamplingParams = GREEDY) -> MigrationRequest:
    ids, items = chat_prompt(prefill, messages)
    seq = prefill.add_request(rid, ids, sampling, items, "messages", prefill_only=True)
    (out,) = run(prefill)[rid]
    assert out.finished and out.migration is not None and seq.status is SeqStatus.ENDED
    assert [s for s, _ in seq.status_history][-2:] == [SeqStatus.TO_BE_MIGRATED, SeqStatus.ENDED]
    assert out.new_token_ids == [out.migration.first_token]
    return MigrationRequest.model_validate_json(out.migration.model_dump_json())  # the wire


def do_decode(decode: LLMEngine, rid: str, messages: list[dict], mr: MigrationRequest,
              sampling: SamplingParams = GREEDY):
    ids, items = decode_prompt(decode.processor, messages, mr)
    seq = decode.add_request(rid, ids, sampling, items, "messages", migration=mr)
    assert seq.status is SeqStatus.WAITING_MIGRATION
    return seq, run(decode)[rid]


def assert_released(prefill: LLMEngine, decode: LLMEngine) -> None:
    def idle() -> bool:
        prefill.step()  # applies acks
        return (not prefill.pd_out.leases and
                prefill.blocks.num_free_blocks == P_BLOCKS)
    assert wait_until(idle)
    for engine, total in ((prefill, P_BLOCKS), (decode, decode.blocks.num_blocks)):
        engine.blocks.check_integrity()
        assert engine.blocks.num_free_blocks == total and not engine.has_unfinished()
    assert decode.hub.migrator.num_in_flight == 0 and not decode.pd_in.busy


@pytest.mark.parametrize("messages", [TEXT, IMAGE], ids=["text", "image"])
def test_pd_matches_reference(llava_dir, prefill, decode, messages):
    mr = do_prefill(prefill, "p1", messages)
    # P keeps the blocks under a lease until D acks; its pool is smaller than D's
    assert prefill.stats().pd_leases_active == 1
    assert prefill.blocks.num_free_blocks == P_BLOCKS - len(mr.block_ids)
    seq, outs = do_decode(decode, "d1", messages, mr)
    assert seq.output_token_ids == reference(llava_dir, messages)
    assert outs[0].new_token_ids == [mr.first_token] and outs[-1].finished
    statuses = [s for s, _ in seq.status_history]
    assert statuses[:5] == [SeqStatus.WAITING_MIGRATION, SeqStatus.RUNNING_MIGRATION,
                            SeqStatus.MIGRATION_LOCKED, SeqStatus.MIGRATION_DONE,
                            SeqStatus.RUNNING]
    assert seq.preemptible is (messages is TEXT)
    assert outs[-1].timings["pd_migration"] > 0
    assert decode.stats().pd_migrations >= 1 and decode.stats().pd_migration_bytes > 0
    assert_released(prefill, decode)


def test_pd_batch_different_block_ids_and_preemption(llava_dir, prefill):
    """Several requests at once, a prefix-cache hit on P, and a tiny D pool that forces
    preemption (text recomputes; the image sequence holds its whole length)."""
    decode = make(llava_dir, "decode", num_blocks=33)  # 2 x 10 + 2 x 6 admitted
    connect(decode, prefill)
    try:
        convs = [TEXT, IMAGE, TEXT, IMAGE]
        mrs = []
        for i, conv in enumerate(convs):
            mrs.append(do_prefill(prefill, f"bp{i}", conv))
        assert mrs[2].num_cached_tokens > 0  # a prefix-cache hit is migrated too
        assert mrs[0].block_ids != mrs[2].block_ids  # each request holds its own tail
        seqs = []
        for i, (conv, mr) in enumerate(zip(convs, mrs, strict=True)):
            ids, items = decode_prompt(decode.processor, conv, mr)
            seqs.append(decode.add_request(f"bd{i}", ids, GREEDY, items, migration=mr))
        run(decode)
        for conv, seq in zip(convs, seqs, strict=True):
            assert seq.output_token_ids == reference(llava_dir, conv)
        assert all(s.num_preemptions == 0 for s in seqs if not s.preemptible)
        assert decode.stats().num_preemptions > 0
        assert_released(prefill, decode)
    finally:
        decode.close()


def test_pd_seeded_sampling_equals_colocated(llava_dir, prefill, decode):
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=7, ignore_eos=True)
    colocated = make(llava_dir, "llm", num_blocks=64)
    try:
        ids, _ = chat_prompt(colocated, TEXT)
        want = colocated.add_request("c", ids, sampling)
        run(colocated)
    finally:
        colocated.close()
    seq, _ = do_decode(decode, "ds", TEXT, do_prefill(prefill, "ps", TEXT, sampling), sampling)
    assert seq.output_token_ids == want.output_token_ids
    assert_released(prefill, decode)


def test_layout_and_prompt_mismatch_refused(prefill, decode):
    mr = do_prefill(prefill, "pm", TEXT)
    ids, items = decode_prompt(decode.processor, TEXT, mr)
    cases = {
        "migration_request.kv_layout": mr.model_copy(update={"kv_layout": {
            **mr.kv_layout, "block_size": 8}, "block_size": 8}),
        "migration_request.transfer_backend": mr.model_copy(update={"transfer_backend": "rdma"}),
        "migration_request.num_tokens": mr.model_copy(update={"num_tokens": mr.num_tokens - 1}),
        "migration_request.prompt_token_ids": mr.model_copy(
            update={"prompt_token_ids": [*mr.prompt_token_ids[:-1], 5]}),
        "migration_request.first_token": mr.model_copy(update={"first_token": 10**6}),
    }
    for param, bad in cases.items():
        with pytest.raises(EPDError) as err:
            decode.add_request("x", ids, GREEDY, items, migration=bad)
        assert err.value.status == 400 and err.value.param == param
    with pytest.raises(EPDError) as err:  # the prefill engine never decodes
        prefill.add_request("y", ids, GREEDY, migration=mr)
    assert err.value.param == "migration_request"
    assert prefill.pd_out.release([mr.lease_id]) == 1
    assert prefill.pd_out.release([mr.lease_id]) == 0  # idempotent
    assert_released(prefill, decode)


def test_pool_layout_checked_at_handshake(prefill, decode):
    """A request that claims our layout but points at a pool with another block size is
    refused once the handshake shows the pool, before any read: 502 pd_migration."""
    mr = do_prefill(prefill, "ph", TEXT)
    bad = mr.model_copy(update={"pool_name": "fake_kv"})
    import torch

    prefill.hub.register_pool("fake_kv", torch.zeros(8, 100, dtype=torch.uint8))
    decode.hub.migrator._peers.clear()  # the next job handshakes again, seeing fake_kv
    ids, items = decode_prompt(decode.processor, TEXT, mr)
    seq = decode.add_request("dh", ids, GREEDY, items, migration=bad)
    (out,) = run(decode)["dh"]
    assert out.exception.status == 502 and out.exception.code == "pd_migration"
    assert "bytes per block" in out.exception.message and seq.status is SeqStatus.ENDED
    assert_released(prefill, decode)  # D acked ok=False: P freed its blocks


def test_failed_read_frees_decode_blocks_and_lease_expiry_frees_prefill(llava_dir, decode):
    prefill = make(llava_dir, "prefill", num_blocks=P_BLOCKS, lease_seconds=0.5)
    try:
        mr = do_prefill(prefill, "pf", TEXT)
        assert prefill.blocks.num_free_blocks < P_BLOCKS

        def refused(url, my_id, timeout_s):
            def handshake(info):
                raise TransferError("connection refused")
            return handshake

        decode.hub.set_handshake(refused)
        ghost = mr.model_copy(update={"engine_id": "ghost-prefill",
                                      "ack_address": "tcp://127.0.0.1:9"})
        seq, outs = do_decode(decode, "df", TEXT, ghost)
        (out,) = outs
        assert out.exception.status == 502 and out.exception.code == "pd_migration"
        assert seq.status is SeqStatus.ENDED
        decode.blocks.check_integrity()
        assert decode.blocks.num_free_blocks == decode.blocks.num_blocks
        # nobody acks: P's lease expires and frees the blocks
        assert wait_until(lambda: not prefill.step() and prefill.blocks.num_free_blocks
                          == P_BLOCKS, timeout_s=5)
        assert prefill.stats().pd_leases_expired == 1 and not prefill.pd_out.leases
        prefill.blocks.check_integrity()
    finally:
        prefill.close()


def test_abort_mid_read_and_first_token_finish(prefill, decode):
    connect(decode, prefill)
    mr = do_prefill(prefill, "pa", TEXT)
    ids, items = decode_prompt(decode.processor, TEXT, mr)
    decode.add_request("da", ids, GREEDY, items, migration=mr)
    decode.step()  # allocates and submits the read
    assert decode.abort("da")
    assert wait_until(lambda: not decode.step() and not decode.pd_in.busy)
    assert_released(prefill, decode)
    # max_tokens=1: the prefill's token is the whole answer; nothing is read
    one = SamplingParams(max_tokens=1, temperature=0.0)
    mr = do_prefill(prefill, "p1t", TEXT, one)
    reads = decode.stats().pd_migrations
    seq, outs = do_decode(decode, "d1t", TEXT, mr, one)
    assert seq.output_token_ids == [mr.first_token] == reference(prefill.config.model_dir,
                                                                  TEXT)[:1]
    assert outs[-1].finish_reason == "length" and decode.stats().pd_migrations == reads
    assert_released(prefill, decode)
