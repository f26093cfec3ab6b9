"""Sequence statuses and finish reasons.

Invariant: live statuses come first and the finished ones (STOPPED, ABORTED, ENDED) last,
so ``status.is_finished`` is a single comparison and sorting by status puts finished
sequences at the end.
"""

from __future__ import annotations

from enum import Enum, IntEnum


class SeqStatus(IntEnum):
    # Standard path (colocated LLM engine, and the prefill side before migration).
    WAITING = 0
    RUNNING = 1
    LOCKED = 2  # inside a forward pass: not schedulable, blocks must not move
    # E -> P: pulling image features from an encoder's mm cache.
    WAITING_EPD_MIGRATION = 3
    RUNNING_EPD_MIGRATION = 4
    EPD_MIGRATION_LOCKED = 5  # transfer in flight: target buffers must not be freed
    # P -> D: the decode engine pulling the prefill's KV blocks.
    WAITING_MIGRATION = 6
    RUNNING_MIGRATION = 7
    MIGRATION_LOCKED = 8  # transfer in flight: target blocks must not be freed
    MIGRATION_DONE = 9
    # Prefill role: prefill done, KV blocks kept until the decode engine acks.
    TO_BE_MIGRATED = 10
    # Finished statuses, ordered last.
    STOPPED = 11  # generation finished normally (stop / length)
    ABORTED = 12  # client abort or error
    ENDED = 13  # released by the engine; terminal

    @property
    def is_finished(self) -> bool:
        return self >= SeqStatus.STOPPED

    @property
    def is_locked(self) -> bool:
        return self in _LOCKED


_LOCKED = frozenset({SeqStatus.LOCKED, SeqStatus.EPD_MIGRATION_LOCKED, SeqStatus.MIGRATION_LOCKED})


class FinishReason(str, Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value
