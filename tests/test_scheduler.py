"""Scheduler unit tests: exact block ids, chunked prefill, preemption, abort."""

from __future__ import annotations

from epd.llm.block_manager import KVBlockManager
from epd.llm.sampling_params import SamplingParams
from epd.llm.scheduler import Scheduler, SchedulerConfig
from epd.llm.sequence import MMItem, Sequence
from epd.statemachine import SeqStatus


def make_scheduler(
    num_blocks=8, block_size=4, budget=64, max_seqs=8, chunked=True, prefix=False
) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=prefix,
    )
    return Scheduler(cfg, KVBlockManager(num_blocks, block_size, enable_prefix_caching=prefix))


def make_request(rid: str, n_prompt: int, start: int = 100, mm=()) -> Sequence:
    return Sequence(
        request_id=rid,
        prompt_token_ids=list(range(start, start + n_prompt)),
        sampling=SamplingParams(max_tokens=8, temperature=0.0),
        mm_items=list(mm),
    )


def step(sched: Scheduler, token: int = 7):
    """One engine step without a model: every sampling sequence gets `token`."""
    out = sched.schedule()
    plan = [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled]
    samplers = [s.seq for s in out.scheduled if s.samples]
    sched.on_step_done(out)
    for seq in samplers:
        seq.append_token(token)
    sched.blocks.check_integrity()
    return plan, out


def tables(sched: Scheduler) -> dict[str, list[int]]:
    return {rid: sched.blocks.block_table(rid) for rid in sched.seqs if sched.blocks.has(rid)}


def test_prefill_then_decode_exact_blocks():
    sched = make_scheduler()
    sched.add(make_request("a", 6))
    sched.add(make_request("b", 3))
    plan, _ = step(sched)
    assert plan == [("a", 6), ("b", 3)]
    assert tables(sched) == {"a": [0, 1], "b": [2]}
    plan, _ = step(sched)  # a: 7 tokens, b: 4 tokens -> still fit
    assert plan == [("b", 1), ("a", 1)]  # decodes packed by context length
    assert tables(sched) == {"a": [0, 1], "b": [2]}
    plan, _ = step(sched)  # b's 5th token needs a new block
    assert plan == [("b", 1), ("a", 1)]
    assert tables(sched) == {"a": [0, 1], "b": [2, 3]}
    assert [s.num_computed_tokens for s in sched.running()] == [8, 5]
    assert all(s.status is SeqStatus.RUNNING for s in sched.running())


def test_chunked_prefill_splits_and_decodes_come_first():
    sched = make_scheduler(budget=4)
    sched.add(make_request("a", 2))
    plan, _ = step(sched)
    assert plan == [("a", 2)]
    sched.add(make_request("b", 10))
    plans = [step(sched)[0] for _ in range(4)]
    # a decodes first every step; b's 10-token prompt is chunked to the rest of the budget.
    assert plans == [
        [("a", 1), ("b", 3)],
        [("a", 1), ("b", 3)],
        [("a", 1), ("b", 3)],
        [("a", 1), ("b", 1)],
    ]
    b = sched.get("b")
    assert b.num_output_tokens == 1  # sampled only when its last chunk ran
    assert sched.blocks.block_table("b") == [1, 2, 3]


def test_packed_order_single_token_entries_first_by_context_length():
    sched = make_scheduler(budget=64)
    sched.add(make_request("a", 5))
    step(sched)
    sched.add(make_request("b", 6))
    sched.add(make_request("c", 1))
    plan, _ = step(sched)
    assert plan == [("c", 1), ("a", 1), ("b", 6)]


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    sched = make_scheduler(budget=8, chunked=False)
    sched.add(make_request("a", 6))
    sched.add(make_request("b", 5))
    plan, _ = step(sched)
    assert plan == [("a", 6)]
    assert sched.get("b").status is SeqStatus.WAITING
    assert not sched.blocks.has("b")  # a rejected allocation leaves nothing behind
    plan, _ = step(sched)
    assert plan == [("a", 1), ("b", 5)]


def test_max_num_seqs_limits_running():
    sched = make_scheduler(max_seqs=2)
    for rid in "abc":
        sched.add(make_request(rid, 2))
    plan, _ = step(sched)
    assert plan == [("a", 2), ("b", 2)]
    assert [s.request_id for s in sched.waiting()] == ["c"]


def test_preemption_by_recompute_latest_first_and_back_to_front():
    sched = make_scheduler(num_blocks=4, block_size=4)
    for rid in "abc":
        sched.add(make_request(rid, 4))
    plan, _ = step(sched)
    assert plan == [("a", 4), ("b", 4), ("c", 4)]
    assert tables(sched) == {"a": [0], "b": [1], "c": [2]}
    sched.add(make_request("d", 2))
    # Each decode needs a 2nd block: a takes block 3, b needs c's block -> c preempted.
    plan, out = step(sched)
    assert plan == [("a", 1), ("b", 1)]
    assert [s.request_id for s in out.preempted] == ["c"]
    assert tables(sched) == {"a": [0, 3], "b": [1, 2]}
    c = sched.get("c")
    assert c.status is SeqStatus.WAITING and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and c.output_token_ids == [7]
    # c arrived before d, so it is back at the front of the waiting queue.
    assert [s.request_id for s in sched.waiting()] == ["c", "d"]
    sched.finish(sched.get("a"), reason="stop")
    assert sched.blocks.num_free_blocks == 2
    plan, _ = step(sched)
    # c recomputes prompt + its generated token (5 tokens) and then samples.
    assert plan == [("b", 1), ("c", 5)]
    assert tables(sched) == {"b": [1, 2], "c": [0, 3]}  # unhashed blocks freed to the front
    assert sched.get("c").output_token_ids == [7, 7]


def test_preempting_the_scheduling_sequence_itself():
    sched = make_scheduler(num_blocks=2, block_size=4)
    sched.add(make_request("a", 4))
    sched.add(make_request("b", 4))
    step(sched)
    # a takes the last... there is none: a preempts b, then a fits in b's block.
    plan, out = step(sched)
    assert plan == [("a", 1)] and [s.request_id for s in out.preempted] == ["b"]
    assert tables(sched) == {"a": [0, 1]}


def test_abort_frees_everything_at_any_point():
    sched = make_scheduler(budget=4)
    sched.add(make_request("a", 3))
    sched.add(make_request("b", 9))
    sched.add(make_request("c", 2))
    step(sched)  # a prefilled, b partially prefilled (1 token), c waiting
    assert sched.get("b").num_computed_tokens == 1
    for rid in "bca":
        seq = sched.abort(rid)
        assert seq.status is SeqStatus.ENDED and seq.finish_reason.value == "abort"
        sched.blocks.check_integrity()
    assert sched.abort("a") is None
    assert not sched.has_unfinished()
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks


def test_finish_frees_blocks_and_ends():
    sched = make_scheduler()
    sched.add(make_request("a", 5))
    step(sched)
    seq = sched.get("a")
    sched.finish(seq, reason="length")
    assert seq.status is SeqStatus.ENDED and seq.finish_reason.value == "length"
    assert [s for s, _ in seq.status_history][:2] == [SeqStatus.WAITING, SeqStatus.RUNNING]
    assert sched.blocks.num_free_blocks == 8


def test_prefix_cache_hit_skips_computed_tokens():
    sched = make_scheduler(prefix=True)
    sched.add(make_request("a", 9))
    step(sched)
    assert tables(sched) == {"a": [0, 1, 2]}
    sched.add(make_request("b", 9))  # same prompt: two full blocks cached
    plan, _ = step(sched)
    assert plan == [("b", 1), ("a", 1)]
    b = sched.get("b")
    assert b.num_cached_tokens == 8
    assert sched.blocks.block_table("b") == [0, 1, 3]
    assert sched.blocks.prefix_cache_stats.hits == 2


def test_prefix_cache_distinguishes_images():
    sched = make_scheduler(prefix=True)
    sched.add(make_request("a", 9, mm=[MMItem(0, 4, "img-1")]))
    step(sched)
    sched.add(make_request("b", 9, mm=[MMItem(0, 4, "img-2")]))
    sched.add(make_request("c", 9, mm=[MMItem(0, 4, "img-1")]))
    step(sched)
    assert sched.get("b").num_cached_tokens == 0
    assert sched.get("c").num_cached_tokens == 8


def test_recompute_after_preemption_reuses_cached_blocks():
    sched = make_scheduler(num_blocks=3, block_size=4, prefix=True)
    sched.add(make_request("a", 4))
    sched.add(make_request("b", 8, start=300))
    step(sched)
    assert tables(sched) == {"a": [0], "b": [1, 2]}
    plan, out = step(sched)  # a needs a 2nd block -> b (latest) preempted
    assert [s.request_id for s in out.preempted] == ["b"]
    sched.finish(sched.get("a"), reason="stop")
    assert tables(sched) == {}
    plan, _ = step(sched)
    # b's blocks were freed tail first, so a's growth evicted b's 2nd block (2) and its
    # first block (1) is still cached: b recomputes 9 - 4 tokens.
    assert plan == [("b", 5)]
    assert sched.blocks.block_table("b")[0] == 1
    assert sched.get("b").num_computed_tokens == 9
