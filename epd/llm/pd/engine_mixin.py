"""The LLM engine's migration glue (EPD features and PD KV blocks, one transfer hub)
and its prefill/decode (PD) roles, mixed into `LLMEngine`.

Invariants: runs on the engine thread only (inside `step()` and `make_sequence`, which
touches no state); every status change goes through `transition()` (in the scheduler
and `PDMigrations`); a handed-over sequence ends in the same step, its blocks kept only
by the producer's hold; a decode sequence's first emitted token is the prefill's.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from epd.errors import EPDError
from epd.llm.outputs import RequestOutput
from epd.llm.sequence import Sequence, TokenLogprob
from epd.statemachine import FinishReason, SeqStatus

logger = logging.getLogger(__name__)


class PDEngineMixin:
    """Uses LLMEngine's attributes below and its `_append`, `_output`,
    `_on_migration_event`."""

    config: Any
    blocks: Any
    layout: Any
    hub: Any
    runner: Any
    spec: Any
    scheduler: Any
    eos_token_ids: frozenset[int]
    max_model_len: int
    pd_in: Any
    pd_out: Any
    epd: Any
    _counters: dict[str, int]

    def _advance_migrations(self) -> list[RequestOutput]:
        if self.pd_out is not None:
            self.pd_out.advance()
        waiting_epd = self.scheduler.with_status(SeqStatus.WAITING_EPD_MIGRATION)
        waiting_pd = self.scheduler.with_status(SeqStatus.WAITING_MIGRATION)
        pd_busy = self.pd_in is not None and self.pd_in.busy
        if not (waiting_epd or waiting_pd or self.epd.busy or pd_busy or self.hub.has_events()):
            return []
        events = self.hub.events()
        failed = self.epd.advance(waiting_epd, events)
        outs: list[RequestOutput] = []
        if self.pd_in is not None:
            outs += self._advance_pd(waiting_pd, events, failed)
        for seq, err in failed:
            self.scheduler.finish(seq, FinishReason.ERROR)
            out = self._output(seq, [], [], "")
            out.error, out.exception = err.message, err
            outs.append(out)
        return outs

    def _start_pd(self) -> None:
        from epd.llm.pd import PDMigrations, PDProducer

        kv = self.runner.kv_cache.tensor
        try:
            if self.config.role == "prefill":
                self.pd_out = PDProducer(self.config, self.blocks, kv, self.layout, self.hub,
                                         notify=self._on_migration_event)
            else:
                self.pd_in = PDMigrations(self.config, self.blocks, kv, self.layout, self.hub,
                                          eos_token_ids=self.eos_token_ids,
                                          max_model_len=self.max_model_len)
                self.scheduler.on_release.append(self.pd_in.release)
        except BaseException:
            self.hub.close()
            raise

    def _check_pd(self, ids, mm_items, epd, prefill_only: bool, migration: Any) -> None:
        role = self.config.role
        if prefill_only and role != "prefill":
            raise EPDError(f"prefill_only needs a prefill engine; this is --role {role}",
                           param="prefill_only")
        if migration is None:
            return
        if role != "decode" or epd is not None:
            raise EPDError(f"migration_request needs a decode engine; this is --role {role}"
                           if epd is None else "encoder_result cannot be combined with "
                           "migration_request", param="migration_request")
        from epd.llm.pd import check_migration

        check_migration(migration, ids, list(mm_items), layout=self.layout,
                        vocab_size=self.spec.vocab_size, backend=self.hub.transfer.name)

    def _first_token(self, seq: Sequence) -> RequestOutput:
        """Decode role: emit the prefill's first token (never recomputed)."""
        mr = seq.migration
        lp = None
        if seq.sampling.logprobs and mr.first_token_logprob is not None:
            top = tuple((int(i), float(v)) for i, v in mr.first_token_top_logprobs)
            lp = TokenLogprob(mr.first_token, mr.first_token_logprob, top)
        if seq.generator is not None and not seq.sampling.greedy:
            # P drew the first token from the same seed: advance this generator past it.
            torch.multinomial(torch.ones(self.spec.vocab_size), 1, generator=seq.generator)
        return self._append(seq, mr.first_token, lp)

    def _hand_over(self, seq: Sequence, token: int, logprob) -> RequestOutput:
        """Prefill role: the first token is sampled; hand the KV blocks over and end."""
        seq.append_token(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        self._counters["generated"] += 1
        try:
            migration = self.pd_out.hand_over(seq)
        except Exception as exc:
            logger.exception("handing over %s failed", seq.request_id)
            self.scheduler.finish(seq, FinishReason.ERROR)
            out = self._output(seq, [], [], "")
            out.error = f"{type(exc).__name__}: {exc}"
            return out
        self.scheduler.hand_over(seq)
        out = self._output(seq, [token], [logprob] if logprob is not None else [], "")
        out.migration = migration
        return out

    def _advance_pd(self, waiting: list[Sequence], events: list, failed: list
                    ) -> list[RequestOutput]:
        """Decode role: start/advance KV reads; emit the first token of ready sequences
        (and of those finished by it, which need no read). Failures go to `failed`."""
        outs, todo = [], []
        for seq in waiting:
            if not self.pd_in.is_blocked(seq.request_id) and self.pd_in.first_token_finishes(seq):
                self.pd_in.skip(seq)  # no KV needed: the ack frees P's blocks
                outs.append(self._first_token(seq))
            else:
                todo.append(seq)
        more_failed, ready = self.pd_in.advance(todo, events)
        failed += more_failed
        return outs + [self._first_token(seq) for seq in ready]
