"""The one table of legal status transitions, and the only function that changes a status.

Invariants:
- ``transition()`` is the only way to change ``obj.status`` after ``init_status()``;
  it rejects any move not in ``LEGAL_TRANSITIONS`` with ``IllegalTransition``.
- Every change is appended to ``obj.status_history`` as ``(status, time.monotonic())``,
  so the history is ordered and its timestamps never decrease.
- A sequence in STOPPED has finish reason ``stop`` or ``length``; one in ABORTED has
  ``abort`` (the default) or ``error``. Nothing leaves ENDED.
- Preemption (by recompute) happens between steps: RUNNING -> WAITING. A LOCKED sequence
  first returns to RUNNING when its forward pass completes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from epd.statemachine.status import FinishReason, SeqStatus

S = SeqStatus

_LIVE = frozenset(s for s in S if not s.is_finished)
_END = frozenset({S.STOPPED, S.ABORTED, S.ENDED})

_EDGES: dict[SeqStatus, set[SeqStatus]] = {
    S.WAITING: {S.RUNNING},
    S.RUNNING: {S.LOCKED, S.WAITING, S.TO_BE_MIGRATED},
    S.LOCKED: {S.RUNNING, S.TO_BE_MIGRATED},
    S.WAITING_EPD_MIGRATION: {S.RUNNING_EPD_MIGRATION},
    S.RUNNING_EPD_MIGRATION: {S.EPD_MIGRATION_LOCKED},
    S.EPD_MIGRATION_LOCKED: {S.WAITING},
    S.WAITING_MIGRATION: {S.RUNNING_MIGRATION},
    S.RUNNING_MIGRATION: {S.MIGRATION_LOCKED},
    S.MIGRATION_LOCKED: {S.MIGRATION_DONE},
    S.MIGRATION_DONE: {S.RUNNING},
    S.TO_BE_MIGRATED: set(),
    S.STOPPED: {S.ENDED},
    S.ABORTED: {S.ENDED},
    S.ENDED: set(),
}

LEGAL_TRANSITIONS: dict[SeqStatus, frozenset[SeqStatus]] = {
    src: frozenset(dsts | (_END if src in _LIVE else set())) for src, dsts in _EDGES.items()
}

# Statuses a sequence may start in (``init_status``).
INITIAL_STATUSES: frozenset[SeqStatus] = frozenset(
    {S.WAITING, S.WAITING_EPD_MIGRATION, S.WAITING_MIGRATION}
)

_REASONS: dict[SeqStatus, frozenset[FinishReason]] = {
    S.STOPPED: frozenset({FinishReason.STOP, FinishReason.LENGTH}),
    S.ABORTED: frozenset({FinishReason.ABORT, FinishReason.ERROR}),
    S.ENDED: frozenset(FinishReason),
}


class IllegalTransition(ValueError):
    def __init__(self, obj: Any, old: SeqStatus | None, new: SeqStatus, detail: str = ""):
        self.obj_id = _ident(obj)
        self.old = old
        self.new = new
        old_name = old.name if old is not None else "<uninitialised>"
        msg = f"illegal status transition {old_name} -> {new.name} for {self.obj_id}"
        super().__init__(msg + (f": {detail}" if detail else ""))


@dataclass(kw_only=True)
class StatusTracked:
    """Base for anything with a status (sequences, migrations). Keyword-only fields, so
    subclasses may add positional fields without defaults."""

    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    status_history: list[tuple[SeqStatus, float]] = field(default_factory=list)


def _ident(obj: Any) -> str:
    for attr in ("request_id", "req_id", "seq_id", "id"):
        value = getattr(obj, attr, None)
        if value is not None:
            return f"{attr}={value!r}"
    return f"{type(obj).__name__}@{id(obj):#x}"


def init_status(obj: Any, status: SeqStatus = SeqStatus.WAITING) -> None:
    """Set the first status (one of INITIAL_STATUSES) and start the history."""
    status = SeqStatus(status)
    if getattr(obj, "status_history", None):
        raise IllegalTransition(obj, obj.status, status, "status already initialised")
    if status not in INITIAL_STATUSES:
        names = ", ".join(s.name for s in sorted(INITIAL_STATUSES))
        raise IllegalTransition(obj, None, status, f"a sequence starts in one of {names}")
    obj.status = status
    obj.finish_reason = None
    obj.status_history = [(status, time.monotonic())]


def transition(obj: Any, new_status: SeqStatus, *, reason: FinishReason | None = None) -> None:
    """Move ``obj`` to ``new_status`` or raise ``IllegalTransition`` (nothing changes then).

    ``reason`` is required for STOPPED (stop/length), defaults to ``abort`` for ABORTED,
    is optional for ENDED (kept from STOPPED/ABORTED otherwise) and is rejected for live
    statuses.
    """
    new_status = SeqStatus(new_status)
    history = getattr(obj, "status_history", None)
    if not history:
        raise IllegalTransition(obj, None, new_status, "call init_status() first")
    old = obj.status
    if new_status not in LEGAL_TRANSITIONS[old]:
        raise IllegalTransition(obj, old, new_status)
    if reason is not None:
        reason = FinishReason(reason)
        if new_status not in _REASONS:
            raise IllegalTransition(
                obj, old, new_status, f"finish reason {reason.value!r} given for a live status"
            )
        if reason not in _REASONS[new_status]:
            allowed = ", ".join(sorted(r.value for r in _REASONS[new_status]))
            raise IllegalTransition(
                obj, old, new_status, f"finish reason {reason.value!r} (allowed: {allowed})"
            )
    elif new_status is S.STOPPED:
        raise IllegalTransition(obj, old, new_status, "STOPPED needs reason stop or length")
    elif new_status is S.ABORTED:
        reason = FinishReason.ABORT
    if reason is not None:
        obj.finish_reason = reason
    obj.status = new_status
    history.append((new_status, time.monotonic()))


def stage_durations(obj: Any, *, now: float | None = None) -> dict[str, float]:
    """Seconds spent in each status (summed over repeated visits). The current status
    counts up to ``now`` (default: time.monotonic()) unless it is a finished one."""
    history = obj.status_history
    out: dict[str, float] = {}
    for (status, start), (_, end) in zip(history, history[1:], strict=False):
        out[status.name] = out.get(status.name, 0.0) + (end - start)
    if history:
        status, start = history[-1]
        if not status.is_finished:
            end = time.monotonic() if now is None else now
            out[status.name] = out.get(status.name, 0.0) + max(0.0, end - start)
    return out


def time_of(obj: Any, status: SeqStatus, *, last: bool = False) -> float | None:
    """The monotonic time ``obj`` first (or, with ``last``, most recently) entered
    ``status``; None if it never did."""
    entries = reversed(obj.status_history) if last else obj.status_history
    for s, t in entries:
        if s == status:
            return t
    return None
