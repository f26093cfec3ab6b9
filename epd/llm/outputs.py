"""What the engine hands back: per-step request outputs and engine statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from epd.llm.sequence import TokenLogprob


@dataclass
class RequestOutput:
    """Incremental output of one request for one engine step (deltas + running totals)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string / token id that matched
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    # An error the client should get as an HTTP error (e.g. a 400/502 from EPD migration);
    # set only before any token was produced.
    exception: Exception | None = None
    timings: dict[str, float] | None = None  # seconds per stage, on the final output
    # Prefill role: the handed-over KV blocks (epd.protocol.MigrationRequest), on the
    # final output of a prefill_only request.
    migration: Any = None


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_used: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    num_generated_tokens: int
    num_prompt_tokens_computed: int
    num_preemptions: int
    num_steps: int
    # EPD migration (LLM-side feature pool; "free" counts cached, unreferenced blocks).
    num_migrating: int = 0
    mm_blocks_total: int = 0
    mm_blocks_free: int = 0
    mm_blocks_referenced: int = 0
    epd_migrations: int = 0
    epd_migrations_failed: int = 0
    # PD, prefill role: KV blocks handed over under leases.
    pd_leases_active: int = 0
    pd_leases_expired: int = 0
    pd_handovers: int = 0
    # PD, decode role: KV blocks pulled from prefill engines (latency: cumulative counts
    # per bound of epd.llm.pd.consumer.LATENCY_BUCKETS).
    pd_num_migrating: int = 0
    pd_migrations: int = 0
    pd_migrations_failed: int = 0
    pd_migration_bytes: int = 0
    pd_migration_seconds_sum: float = 0.0
    pd_migration_seconds_buckets: tuple[int, ...] = ()


@dataclass
class GenerationOutput:
    """A finished request in the offline API."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
