"""A request inside the LLM engine.

Invariants: `token_ids == prompt_token_ids + output_token_ids`; tokens
`[0, num_computed_tokens)` have their K/V in the sequence's blocks; `status` changes only
through `epd.statemachine.transition()`. Image items cover placeholder spans of the
prompt; their feature rows are spliced into the input embeddings at those positions.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from epd.llm.detokenizer import DetokState
from epd.llm.sampling_params import SamplingParams
from epd.statemachine import SeqStatus, StatusTracked, init_status, stage_durations

_arrival_counter = itertools.count()


@dataclass
class MMItem:
    offset: int  # first placeholder position in the prompt
    length: int  # number of placeholder tokens (= feature rows)
    mm_hash: str
    image: Any = None  # epd.models ImageInput (local vision) or None
    features: torch.Tensor | None = None  # [length, hidden] once encoded / migrated

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


@dataclass(kw_only=True)
class Sequence(StatusTracked):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    mm_items: list[MMItem] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at the first allocation
    block_hashes: list[bytes] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.time)
    arrival_index: int = field(default_factory=lambda: next(_arrival_counter))
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    detok: DetokState = field(default_factory=DetokState)
    stop_reason: str | int | None = None
    first_token_mono: float | None = None  # time.monotonic(), comparable to status_history
    # EPD: where the image features are (epd.llm.migration.EPDRequest); the sequence
    # starts in WAITING_EPD_MIGRATION and holds refs on its LLM-side feature entries.
    epd: Any = None
    epd_entries: list[Any] = field(default_factory=list)
    # PD: a prefill-role sequence ends after its first token, handing its KV blocks over
    # (TO_BE_MIGRATED); a decode-role one (`migration`: epd.protocol.MigrationRequest)
    # starts in WAITING_MIGRATION and pulls them. `preemptible` False: never preempted
    # (a migrated sequence with images: the decode engine cannot recompute its features).
    prefill_only: bool = False
    migration: Any = None
    preemptible: bool = True

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
        self.mm_items = sorted(self.mm_items, key=lambda m: m.offset)
        if self.sampling.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling.seed)
        if not self.status_history:
            first = SeqStatus.WAITING
            if self.epd is not None:
                first = SeqStatus.WAITING_EPD_MIGRATION
            elif self.migration is not None:
                first = SeqStatus.WAITING_MIGRATION
            init_status(self, first)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def text(self) -> str:
        return self.detok.text

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_tokens - 1

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.time()
            self.first_token_mono = time.monotonic()


_EPD_STATUSES = frozenset(
    {SeqStatus.WAITING_EPD_MIGRATION, SeqStatus.RUNNING_EPD_MIGRATION,
     SeqStatus.EPD_MIGRATION_LOCKED}
)
_PD_STATUSES = frozenset(
    {SeqStatus.WAITING_MIGRATION, SeqStatus.RUNNING_MIGRATION, SeqStatus.MIGRATION_LOCKED,
     SeqStatus.MIGRATION_DONE}
)


def stage_timings(seq: Sequence) -> dict[str, float]:
    """Seconds per stage (`epd_timings` in responses), from `stage_durations`: `queue`
    (WAITING), `epd_migration` (the three EPD migration statuses), `pd_migration` (the
    four KV migration statuses, decode role only), `prefill` / `decode`
    (RUNNING + LOCKED before / after the first token), `total`."""
    d = stage_durations(seq)
    running = d.get("RUNNING", 0.0) + d.get("LOCKED", 0.0)
    decode = 0.0
    split, hist = seq.first_token_mono, seq.status_history
    if split is not None:
        for (status, start), (_, end) in zip(hist, hist[1:], strict=False):
            if status in (SeqStatus.RUNNING, SeqStatus.LOCKED) and end > split:
                decode += end - max(start, split)
    out = {
        "queue": d.get("WAITING", 0.0),
        "epd_migration": sum(d.get(s.name, 0.0) for s in _EPD_STATUSES),
        "pd_migration": sum(d.get(s.name, 0.0) for s in _PD_STATUSES),
        "prefill": max(0.0, running - decode),
        "decode": decode,
        "total": sum(d.values()),
    }
    return {k: round(v, 6) for k, v in out.items()}
