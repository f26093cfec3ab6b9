"""Prefill-decode disaggregation in the LLM engine: the prefill role hands a finished
prefill's KV blocks over under a lease (`PDProducer`), the decode role pulls them with the
shared `BlockMigrator` (`PDMigrations`) and decodes."""

from __future__ import annotations

from epd.llm.pd.consumer import STAGE, PDMigrations
from epd.llm.pd.producer import KV_POOL, PDProducer, kv_layout_of
from epd.llm.pd.validate import check_migration, decode_prompt

__all__ = [
    "KV_POOL",
    "STAGE",
    "PDMigrations",
    "PDProducer",
    "check_migration",
    "decode_prompt",
    "kv_layout_of",
]
