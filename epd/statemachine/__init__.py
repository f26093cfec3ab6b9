"""The one state machine of epd: statuses, legal transitions, per-stage timing.

Only ``init_status()`` and ``transition()`` may change a status; queues are derived
from status, never kept in parallel.
"""

from __future__ import annotations

from epd.statemachine.status import FinishReason, SeqStatus
from epd.statemachine.transitions import (
    INITIAL_STATUSES,
    LEGAL_TRANSITIONS,
    IllegalTransition,
    StatusTracked,
    init_status,
    stage_durations,
    time_of,
    transition,
)

__all__ = [
    "INITIAL_STATUSES",
    "LEGAL_TRANSITIONS",
    "FinishReason",
    "IllegalTransition",
    "SeqStatus",
    "StatusTracked",
    "init_status",
    "stage_durations",
    "time_of",
    "transition",
]
