from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import pytest

from epd.statemachine import (
    INITIAL_STATUSES,
    LEGAL_TRANSITIONS,
    FinishReason,
    IllegalTransition,
    SeqStatus,
    StatusTracked,
    diagram,
    init_status,
    stage_durations,
    time_of,
    transition,
)

S = SeqStatus


@dataclass
class Seq(StatusTracked):
    request_id: str  # positional field after the base's defaulted ones (kw_only base)


def make_seq(status: SeqStatus, request_id: str = "req-1") -> Seq:
    """A sequence in ``status``, reached through legal transitions only."""
    seq = Seq(request_id)
    paths = {
        S.RUNNING: [S.RUNNING],
        S.LOCKED: [S.RUNNING, S.LOCKED],
        S.RUNNING_EPD_MIGRATION: [S.RUNNING_EPD_MIGRATION],
        S.EPD_MIGRATION_LOCKED: [S.RUNNING_EPD_MIGRATION, S.EPD_MIGRATION_LOCKED],
        S.RUNNING_MIGRATION: [S.RUNNING_MIGRATION],
        S.MIGRATION_LOCKED: [S.RUNNING_MIGRATION, S.MIGRATION_LOCKED],
        S.MIGRATION_DONE: [S.RUNNING_MIGRATION, S.MIGRATION_LOCKED, S.MIGRATION_DONE],
        S.TO_BE_MIGRATED: [S.RUNNING, S.TO_BE_MIGRATED],
        S.STOPPED: [S.RUNNING, S.STOPPED],
        S.ABORTED: [S.ABORTED],
        S.ENDED: [S.ENDED],
    }
    start = status if status in INITIAL_STATUSES else S.WAITING
    if status in (S.RUNNING_EPD_MIGRATION, S.EPD_MIGRATION_LOCKED):
        start = S.WAITING_EPD_MIGRATION
    if status in (S.RUNNING_MIGRATION, S.MIGRATION_LOCKED, S.MIGRATION_DONE):
        start = S.WAITING_MIGRATION
    init_status(seq, start)
    for step in paths.get(status, []):
        transition(seq, step, reason=FinishReason.STOP if step is S.STOPPED else None)
    assert seq.status is status
    return seq


def _reason_for(dst: SeqStatus) -> FinishReason | None:
    return FinishReason.STOP if dst is S.STOPPED else None


def test_status_order_and_is_finished():
    finished = [s for s in S if s.is_finished]
    assert finished == [S.STOPPED, S.ABORTED, S.ENDED]
    assert max(s for s in S if not s.is_finished) < min(finished)
    assert {s for s in S if s.is_locked} == {S.LOCKED, S.EPD_MIGRATION_LOCKED, S.MIGRATION_LOCKED}
    assert [r.value for r in FinishReason] == ["stop", "length", "abort", "error"]
    assert FinishReason("length") is FinishReason.LENGTH


def test_table_covers_every_status_and_required_edges():
    assert set(LEGAL_TRANSITIONS) == set(S)
    required = [
        (S.WAITING, S.RUNNING),
        (S.RUNNING, S.LOCKED),
        (S.LOCKED, S.RUNNING),
        (S.RUNNING, S.WAITING),
        (S.WAITING_EPD_MIGRATION, S.RUNNING_EPD_MIGRATION),
        (S.RUNNING_EPD_MIGRATION, S.EPD_MIGRATION_LOCKED),
        (S.EPD_MIGRATION_LOCKED, S.WAITING),
        (S.WAITING_MIGRATION, S.RUNNING_MIGRATION),
        (S.RUNNING_MIGRATION, S.MIGRATION_LOCKED),
        (S.MIGRATION_LOCKED, S.MIGRATION_DONE),
        (S.MIGRATION_DONE, S.RUNNING),
        (S.RUNNING, S.TO_BE_MIGRATED),
        (S.LOCKED, S.TO_BE_MIGRATED),
        (S.TO_BE_MIGRATED, S.ENDED),
        (S.STOPPED, S.ENDED),
        (S.ABORTED, S.ENDED),
    ]
    for src, dst in required:
        assert dst in LEGAL_TRANSITIONS[src], (src, dst)
    for src in S:
        if not src.is_finished:
            assert {S.STOPPED, S.ABORTED, S.ENDED} <= LEGAL_TRANSITIONS[src]
    assert LEGAL_TRANSITIONS[S.ENDED] == frozenset()
    assert S.WAITING not in LEGAL_TRANSITIONS[S.LOCKED]  # preempt only between steps


@pytest.mark.parametrize("src,dst", list(itertools.product(S, S)))
def test_every_pair(src, dst):
    seq = make_seq(src)
    before = list(seq.status_history)
    if dst in LEGAL_TRANSITIONS[src]:
        transition(seq, dst, reason=_reason_for(dst))
        assert seq.status is dst
        assert seq.status_history[:-1] == before
        assert seq.status_history[-1][0] is dst
    else:
        with pytest.raises(IllegalTransition) as exc:
            transition(seq, dst, reason=_reason_for(dst))
        msg = str(exc.value)
        assert src.name in msg and dst.name in msg and "req-1" in msg
        assert exc.value.old is src and exc.value.new is dst
        assert seq.status is src and seq.status_history == before


def test_init_status_rules():
    for s in INITIAL_STATUSES:
        seq = Seq("a")
        init_status(seq, s)
        assert seq.status is s and seq.status_history[0][0] is s
    with pytest.raises(IllegalTransition, match="RUNNING"):
        init_status(Seq("b"), S.RUNNING)
    seq = make_seq(S.RUNNING)
    with pytest.raises(IllegalTransition, match="already"):
        init_status(seq, S.WAITING)
    with pytest.raises(IllegalTransition, match="init_status"):
        transition(Seq("c"), S.RUNNING)


def test_timestamps_monotone_and_recorded():
    seq = Seq("t")
    t0 = time.monotonic()
    init_status(seq)
    for _ in range(3):
        transition(seq, S.RUNNING)
        transition(seq, S.LOCKED)
        transition(seq, S.RUNNING)
        transition(seq, S.WAITING)
    transition(seq, S.RUNNING)
    transition(seq, S.STOPPED, reason="length")
    transition(seq, S.ENDED)
    t1 = time.monotonic()
    times = [t for _, t in seq.status_history]
    assert len(times) == 16
    assert times == sorted(times) and t0 <= times[0] and times[-1] <= t1
    assert time_of(seq, S.WAITING) == times[0]
    assert time_of(seq, S.RUNNING) == times[1]
    assert time_of(seq, S.RUNNING, last=True) == times[13]
    assert time_of(seq, S.ABORTED) is None
    durations = stage_durations(seq)
    assert set(durations) == {"WAITING", "RUNNING", "LOCKED", "STOPPED"}
    assert sum(durations.values()) == pytest.approx(times[-1] - times[0])
    assert durations["LOCKED"] == pytest.approx(sum(times[i + 1] - times[i] for i in (2, 6, 10)))


def test_stage_durations_counts_current_live_status_until_now():
    seq = make_seq(S.RUNNING)
    (_, t_wait), (_, t_run) = seq.status_history
    d = stage_durations(seq, now=t_run + 2.5)
    assert d == {"WAITING": t_run - t_wait, "RUNNING": 2.5}


def test_finish_reasons():
    seq = make_seq(S.RUNNING)
    with pytest.raises(IllegalTransition, match="stop or length"):
        transition(seq, S.STOPPED)
    with pytest.raises(IllegalTransition, match="abort"):
        transition(seq, S.STOPPED, reason=FinishReason.ABORT)
    with pytest.raises(IllegalTransition, match="live status"):
        transition(seq, S.LOCKED, reason=FinishReason.STOP)
    assert seq.status is S.RUNNING and seq.finish_reason is None
    transition(seq, S.STOPPED, reason=FinishReason.LENGTH)
    assert seq.finish_reason is FinishReason.LENGTH
    transition(seq, S.ENDED)
    assert seq.finish_reason is FinishReason.LENGTH  # kept

    seq = make_seq(S.LOCKED)
    transition(seq, S.ABORTED)
    assert seq.finish_reason is FinishReason.ABORT
    seq = make_seq(S.MIGRATION_LOCKED)
    transition(seq, S.ABORTED, reason="error")
    assert seq.finish_reason is FinishReason.ERROR
    with pytest.raises(IllegalTransition, match="stop"):
        transition(make_seq(S.WAITING), S.ABORTED, reason=FinishReason.STOP)


def test_message_names_object_without_request_id():
    class Bare:
        pass

    obj = Bare()
    init_status(obj)
    with pytest.raises(IllegalTransition, match=r"WAITING -> MIGRATION_DONE for Bare@0x"):
        transition(obj, S.MIGRATION_DONE)
    assert isinstance(IllegalTransition(obj, S.WAITING, S.ENDED), ValueError)


def test_doc_matches_table(tmp_path):
    assert diagram.main(["--check"]) == 0, "run python -m epd.statemachine.diagram"
    text = diagram.DEFAULT_PATH.read_text()
    for src, dsts in LEGAL_TRANSITIONS.items():
        for dst in dsts:
            assert f"    {src.name} --> {dst.name}\n" in text
    edges = sum(len(d) for d in LEGAL_TRANSITIONS.values())
    assert text.count(" --> ") == edges + len(INITIAL_STATUSES) + 1
    stale = tmp_path / "state-machine.md"
    stale.write_text(text.replace("    RUNNING --> LOCKED\n", ""))
    assert diagram.main(["--check", "--path", str(stale)]) == 1
    assert diagram.main(["--path", str(stale)]) == 0
    assert stale.read_text() == text
