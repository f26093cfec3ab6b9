"""The synchronous LLM engine: add requests, `step()` until done.

Invariants: each `step()` is schedule -> one packed forward -> sample -> update; every
status change goes through `transition()`; a finished or aborted request's blocks are
freed in the same step (the free-block count returns to its start value once idle); an
error in the forward pass finishes the affected requests with finish_reason "error" and
the engine keeps serving.

EPD requests (a `Sequence` with `epd`) start in WAITING_EPD_MIGRATION; `EPDMigrations`
(epd.llm.migration) pulls their image features on its migrator thread, and each step
first applies its events on this thread (the only thread that changes statuses), so a
transfer never holds up decoding. `wakeup` (set by the async front) is called when a
migration event arrives; `idle_wait_s` lets a synchronous caller's idle step sleep on
those events instead of spinning.

PD (`config.role`): a prefill engine ends a `prefill_only` sequence after its first token
and hands its KV blocks over under a lease (`PDProducer`; the output carries the
`migration` request); a decode engine admits sequences with a `migration` in
WAITING_MIGRATION, pulls the blocks (`PDMigrations`), emits the prefill's first token and
decodes. Both kinds of migration share one transfer engine and migrator (`TransferHub`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import torch

from epd.errors import EPDError
from epd.llm.block_manager import KVBlockManager
from epd.llm.config import EngineConfig
from epd.llm.detokenizer import IncrementalDetokenizer
from epd.llm.migration import EPDMigrations, TransferHub
from epd.llm.model_runner import ModelRunner
from epd.llm.outputs import EngineStats, RequestOutput
from epd.llm.pd.engine_mixin import PDEngineMixin
from epd.llm.sampler import Sampler
from epd.llm.sampling_params import SamplingParams
from epd.llm.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from epd.llm.sequence import MMItem, Sequence, stage_timings
from epd.statemachine import FinishReason, SeqStatus, transition

logger = logging.getLogger(__name__)


class LLMEngine(PDEngineMixin):
    def __init__(self, config: EngineConfig) -> None:
        from epd.models import MultimodalProcessor

        self.config = config
        torch.manual_seed(config.seed)
        self.runner = ModelRunner(config)
        self.spec = self.runner.spec
        self.layout = self.runner.layout
        self.processor = MultimodalProcessor.from_pretrained(config.model_dir)
        self.tokenizer = self.processor.tokenizer
        self.eos_token_ids = frozenset(self.spec.eos_token_ids)
        self.max_model_len = self.layout.max_model_len
        self.blocks = KVBlockManager(
            self.layout.num_blocks, self.layout.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                enable_chunked_prefill=config.enable_chunked_prefill,
                enable_prefix_caching=config.enable_prefix_caching,
            ),
            self.blocks,
        )
        self.sampler = Sampler(torch.Generator(device=self.runner.device).manual_seed(config.seed))
        self.detok = IncrementalDetokenizer(self.tokenizer)
        self._pending: list[RequestOutput] = []
        self._counters = {"generated": 0, "prompt": 0, "preemptions": 0, "steps": 0}
        self.wakeup: Callable[[], None] = lambda: None
        self.idle_wait_s = 0.005
        self._migration_event = threading.Event()
        self.hub = TransferHub(config, notify=self._on_migration_event)
        self.epd = EPDMigrations(config, hidden_size=self.spec.hidden_size,
                                 dtype=self.runner.dtype, hub=self.hub)
        self.scheduler.on_release.append(self._release_epd)
        self.pd_out: Any = None  # prefill role: epd.llm.pd.PDProducer
        self.pd_in: Any = None  # decode role: epd.llm.pd.PDMigrations
        if config.role != "llm":
            self._start_pd()

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        sampling: SamplingParams | None = None,
        mm_items: Seq[MMItem] = (),
        prompt_param: str = "prompt",
        epd: Any = None,
        prefill_only: bool = False,
        migration: Any = None,
    ) -> Sequence:
        seq = self.make_sequence(request_id, prompt_token_ids, sampling, mm_items, prompt_param,
                                 epd, prefill_only=prefill_only, migration=migration)
        self.add_sequence(seq)
        return seq

    def make_sequence(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        sampling: SamplingParams | None = None,
        mm_items: Seq[MMItem] = (),
        prompt_param: str = "prompt",
        epd: Any = None,
        *,
        prefill_only: bool = False,
        migration: Any = None,
    ) -> Sequence:
        """Validate a request (EPDError 400 naming the parameter) into a new Sequence.
        Touches no engine state, so any thread may call it."""
        sampling = sampling or SamplingParams()
        ids = list(prompt_token_ids)
        if not ids:
            raise EPDError("the prompt is empty", param=prompt_param)
        vocab = self.spec.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise EPDError(f"prompt token ids must be in [0, {vocab})", param=prompt_param)
        sampling.validate(self.max_model_len, len(ids), prompt_param)
        for m in mm_items:
            if m.offset < 0 or m.end > len(ids):
                raise EPDError("an image span lies outside the prompt", param=prompt_param)
        if epd is not None and len(epd.images) != len(mm_items):
            raise EPDError(f"{len(epd.images)} encoded images for {len(mm_items)} image spans",
                           param="encoder_result")
        self._check_pd(ids, mm_items, epd, prefill_only, migration)
        kv_tokens = len(ids) if prefill_only else len(ids) + sampling.max_tokens
        need = self.blocks.blocks_needed(min(kv_tokens, self.max_model_len))
        if need > self.layout.num_blocks:
            raise EPDError(
                f"the request needs {need} KV blocks, the cache has {self.layout.num_blocks}",
                param=prompt_param,
            )
        return Sequence(
            request_id=request_id, prompt_token_ids=ids, sampling=sampling,
            mm_items=list(mm_items), epd=epd, prefill_only=prefill_only, migration=migration,
            preemptible=migration is None or not mm_items,
        )

    def add_sequence(self, seq: Sequence) -> None:
        if self.scheduler.get(seq.request_id) is not None:
            raise EPDError(f"request id {seq.request_id!r} is already in use", param="request_id")
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        self._pending.append(self._output(seq, [], [], ""))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def has_work(self) -> bool:
        """Whether a step now could make progress (outputs to hand out, sequences to
        schedule, migrations to start or migration events to apply)."""
        s = self.scheduler
        return bool(
            self._pending or self.epd.has_events()
            or any(q.status in _STEPPABLE for q in s.seqs.values())
            or any(not self.epd.is_blocked(q.request_id)
                   for q in s.with_status(SeqStatus.WAITING_EPD_MIGRATION))
            or (self.pd_out is not None and self.pd_out.has_work())
            or (self.pd_in is not None and any(
                not self.pd_in.is_blocked(q.request_id)
                for q in s.with_status(SeqStatus.WAITING_MIGRATION)))
        )

    def idle_timeout_s(self, poll_s: float) -> float | None:
        """How long an idle engine loop may sleep before a step is due again (None: until
        woken): `poll_s` while requests are pending, else until the next lease expires."""
        if self.scheduler.has_unfinished():
            return poll_s
        return self.pd_out.seconds_to_next_expiry() if self.pd_out is not None else None

    def close(self) -> None:
        """Stop the migrator and the transfer engine (after aborting everything)."""
        if self.pd_out is not None:
            self.pd_out.close()
        self.hub.close()

    def _on_migration_event(self) -> None:
        self._migration_event.set()
        self.wakeup()

    def _release_epd(self, seq: Sequence) -> None:
        if seq.epd is not None:
            self.epd.release(seq)

    # -- the step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        outputs += self._advance_migrations()
        sched = self.scheduler.schedule()
        self._counters["preemptions"] += len(sched.preempted)
        if sched.is_empty:
            busy = self.epd.busy or (self.pd_in is not None and self.pd_in.busy)
            if self.idle_wait_s and busy and not outputs:
                self._migration_event.wait(self.idle_wait_s)
            self._migration_event.clear()
            return outputs
        self._counters["steps"] += 1
        samplers = [s.seq for s in sched.scheduled if s.samples]
        for s in sched.scheduled:
            transition(s.seq, SeqStatus.LOCKED)
        try:
            logits = self.runner.execute(sched.scheduled, self.blocks.block_table)
        except Exception as exc:  # keep serving: fail only this batch
            logger.exception("forward pass failed")
            return outputs + self._fail(sched, exc)
        for s in sched.scheduled:
            transition(s.seq, SeqStatus.RUNNING)
            if s.seq.num_computed_tokens < s.seq.num_prompt_tokens:
                self._counters["prompt"] += min(
                    s.num_new_tokens, s.seq.num_prompt_tokens - s.seq.num_computed_tokens
                )
        self.scheduler.on_step_done(sched)
        if samplers:
            result = self.sampler(
                logits, [q.sampling for q in samplers], [q.generator for q in samplers]
            )
            for seq, tok, lp in zip(samplers, result.token_ids, result.logprobs, strict=True):
                if seq.prefill_only:
                    outputs.append(self._hand_over(seq, tok, lp))
                else:
                    outputs.append(self._append(seq, tok, lp))
        return outputs

    def _append(self, seq: Sequence, token: int, logprob) -> RequestOutput:
        seq.append_token(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        self._counters["generated"] += 1
        sp = seq.sampling
        reason, stop_reason = None, None
        if token in sp.stop_token_ids:
            reason, stop_reason = FinishReason.STOP, token
        elif not sp.ignore_eos and token in self.eos_token_ids:
            reason = FinishReason.STOP
        else:
            self.detok.append(seq.detok, seq.output_token_ids)
            stop_reason = self.detok.find_stop(seq.detok, sp.stop)
            if stop_reason is not None:
                reason = FinishReason.STOP
            elif seq.num_output_tokens >= sp.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = FinishReason.LENGTH
        if reason is not None and not isinstance(stop_reason, str):
            # Finished without a stop string: hand out the held-back end as well.
            ids = seq.output_token_ids[:-1] if stop_reason is not None else seq.output_token_ids
            self.detok.flush(seq.detok, ids)
        text = self.detok.emit(seq.detok, sp.stop, final=reason is not None)
        if reason is not None:
            seq.stop_reason = stop_reason
            self.scheduler.finish(seq, reason)
        return self._output(seq, [token], [logprob] if logprob is not None else [], text)

    def _fail(self, sched: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        outs = []
        for s in sched.scheduled:
            self.scheduler.finish(s.seq, FinishReason.ERROR)
            out = self._output(s.seq, [], [], "")
            out.error = f"{type(exc).__name__}: {exc}"
            outs.append(out)
        return outs

    def _output(self, seq: Sequence, new_ids, new_lps, new_text: str) -> RequestOutput:
        finished = seq.status.is_finished
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=list(new_ids),
            new_text=new_text,
            new_logprobs=list(new_lps),
            finished=finished,
            finish_reason=str(seq.finish_reason) if finished and seq.finish_reason else None,
            stop_reason=seq.stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            timings=stage_timings(seq) if finished else None,
        )

    # -- introspection ---------------------------------------------------------------
    def stats(self) -> EngineStats:
        pc = self.blocks.prefix_cache_stats
        return EngineStats(
            num_running=len(self.scheduler.running()),
            num_waiting=len(self.scheduler.waiting()),
            kv_blocks_total=self.blocks.num_blocks,
            kv_blocks_free=self.blocks.num_free_blocks,
            kv_blocks_used=self.blocks.num_used_blocks,
            prefix_cache_queries=pc.queries,
            prefix_cache_hits=pc.hits,
            prefix_cache_hit_rate=pc.hit_rate,
            num_generated_tokens=self._counters["generated"],
            num_prompt_tokens_computed=self._counters["prompt"],
            num_preemptions=self._counters["preemptions"],
            num_steps=self._counters["steps"],
            **self.epd.stats(),
            **(self.pd_out.stats() if self.pd_out is not None else {}),
            **(self.pd_in.stats() if self.pd_in is not None else {}),
        )


_STEPPABLE = frozenset({SeqStatus.WAITING, SeqStatus.RUNNING})
