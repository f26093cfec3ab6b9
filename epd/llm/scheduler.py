"""Continuous-batching scheduler with chunked prefill and preemption by recompute.

Invariants:
- Queues derive from status: `running()` / `waiting()` are the sequences in RUNNING /
  WAITING, ordered by arrival (FCFS). Sequences in an EPD or PD migration status are held
  but never scheduled; the engine moves them to WAITING (features arrived) or RUNNING (KV
  blocks arrived). A preempted sequence keeps its arrival index, so it goes back to the
  front of the waiting queue (everything still waiting arrived later).
- Each step schedules at most `max_num_batched_tokens` tokens and `max_num_seqs` running
  sequences: running sequences first (decodes and unfinished prefill chunks), then
  waiting ones, whose prompt is chunked to the remaining budget when chunking is on.
- When blocks run out, the latest-arrived preemptible running sequence is preempted (a
  non-preemptible one holds blocks for its whole length, so never needs more): its blocks are
  freed, `num_computed_tokens` resets to 0 and it later recomputes prompt + generated
  tokens (greedy/seeded requests then produce exactly the same tokens).
- Every block a sequence holds is freed when it finishes or is aborted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from epd.llm.block_manager import KVBlockManager, MMSpanHash, hash_block_tokens
from epd.llm.sequence import Sequence
from epd.statemachine import FinishReason, SeqStatus, transition

_NEW_STATUSES = (SeqStatus.WAITING, SeqStatus.WAITING_EPD_MIGRATION, SeqStatus.WAITING_MIGRATION)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def num_computed_tokens(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the sequence's last token: a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # packed order
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: KVBlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.block_size = block_manager.block_size
        self.seqs: dict[str, Sequence] = {}
        # Called with every sequence that ends (finished or aborted), after its KV blocks
        # are freed: owners of other per-sequence resources (EPD features) release them.
        self.on_release: list[Callable[[Sequence], None]] = []

    # -- queues (derived from status) ------------------------------------------------
    def with_status(self, status: SeqStatus) -> list[Sequence]:
        return sorted(
            (s for s in self.seqs.values() if s.status is status), key=lambda s: s.arrival_index
        )

    def running(self) -> list[Sequence]:
        return self.with_status(SeqStatus.RUNNING)

    def waiting(self) -> list[Sequence]:
        return self.with_status(SeqStatus.WAITING)

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    def get(self, request_id: str) -> Sequence | None:
        return self.seqs.get(request_id)

    # -- requests --------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.seqs:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        if seq.status not in _NEW_STATUSES:
            raise ValueError(
                f"a new sequence must be WAITING, WAITING_EPD_MIGRATION or WAITING_MIGRATION, "
                f"not {seq.status.name}"
            )
        self._update_hashes(seq)
        self.seqs[seq.request_id] = seq

    def _update_hashes(self, seq: Sequence) -> None:
        """Extend seq.block_hashes to every full block of its tokens (incremental)."""
        if not self.config.enable_prefix_caching:
            return
        if len(seq.block_hashes) >= seq.num_tokens // self.block_size:
            return
        spans = [MMSpanHash(m.offset, m.length, m.mm_hash) for m in seq.mm_items]
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        seq.block_hashes.extend(
            hash_block_tokens(
                seq.token_ids, self.block_size, spans, parent, start_block=len(seq.block_hashes)
            )
        )

    def abort(self, request_id: str) -> Sequence | None:
        seq = self.seqs.get(request_id)
        if seq is None:
            return None
        transition(seq, SeqStatus.ABORTED, reason=FinishReason.ABORT)
        self._release(seq)
        return seq

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        status = SeqStatus.ABORTED if reason == FinishReason.ERROR else SeqStatus.STOPPED
        transition(seq, status, reason=reason)
        self._release(seq)

    def hand_over(self, seq: Sequence) -> None:
        """Prefill role: the sequence's KV blocks were handed to another process (the
        caller holds them); it ends here without a finish reason."""
        transition(seq, SeqStatus.TO_BE_MIGRATED)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        if self.blocks.has(seq.request_id):
            self.blocks.free(seq.request_id)
        transition(seq, SeqStatus.ENDED)
        del self.seqs[seq.request_id]
        for hook in self.on_release:
            hook(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq.request_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        transition(seq, SeqStatus.WAITING)

    # -- the step --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        running = self.running()
        # 1. Running sequences (FCFS): decode tokens and unfinished prefill chunks.
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._reserve(seq, seq.num_computed_tokens + n, running, out.preempted):
                break  # seq itself was preempted: nothing after it can run either
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        # 2. Waiting sequences (FCFS), only if nothing had to be preempted this step.
        num_running = len(running)
        for seq in [] if out.preempted else self.waiting():
            if num_running >= self.config.max_num_seqs or budget <= 0:
                break
            alloc = self.blocks.allocate(seq.request_id, seq.num_tokens, seq.block_hashes)
            if alloc is None:
                break
            n = seq.num_tokens - alloc.num_cached_tokens
            if n > budget and not self.config.enable_chunked_prefill:
                self.blocks.free(seq.request_id)
                break
            n = min(n, budget)
            seq.num_computed_tokens = alloc.num_cached_tokens
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = alloc.num_cached_tokens
            transition(seq, SeqStatus.RUNNING)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            num_running += 1
        # Packed order: single-token entries first (batched decode attention), sorted by
        # context length so that decode groups pad little; then the prefill chunks.
        out.scheduled.sort(
            key=lambda s: (s.num_new_tokens != 1, s.seq.num_computed_tokens * (s.num_new_tokens == 1))
        )
        return out

    def _reserve(
        self, seq: Sequence, num_tokens: int, running: list[Sequence], preempted: list[Sequence]
    ) -> bool:
        """Grow seq's blocks to num_tokens, preempting from the back of `running`."""
        while not self.blocks.append_slots(seq.request_id, num_tokens):
            k = max(j for j, q in enumerate(running) if q.preemptible or q is seq)
            victim = running.pop(k)
            if not victim.preemptible:  # seq itself, with all of its blocks: cannot happen
                raise RuntimeError(f"{seq.request_id!r} is not preemptible but needs blocks")
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def on_step_done(self, out: SchedulerOutput) -> None:
        """Advance computed-token counts and publish newly full blocks to the prefix cache."""
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens
            if self.config.enable_prefix_caching:
                self._update_hashes(seq)
                self.blocks.cache_blocks(seq.request_id, seq.block_hashes, seq.num_computed_tokens)
