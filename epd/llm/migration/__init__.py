"""Block migration into this engine: the generic `BlockMigrator` (a thread that pulls a
peer's blocks over the transfer layer, with deadlines and acks) and its E -> P use,
`EPDMigrations` (image features from encoders' multimodal caches)."""

from __future__ import annotations

from epd.llm.migration.epd_migration import POOL_NAME, EPDMigrations
from epd.llm.migration.hub import TransferHub
from epd.llm.migration.migrator import AckOnDone, BlockMigrator, MigrationEvent, MigrationJob
from epd.llm.migration.validate import (
    EPDImage,
    EPDRequest,
    check_encoder_results,
    epd_prompt,
    pool_check,
)

__all__ = [
    "POOL_NAME",
    "AckOnDone",
    "BlockMigrator",
    "EPDImage",
    "EPDMigrations",
    "EPDRequest",
    "MigrationEvent",
    "MigrationJob",
    "TransferHub",
    "check_encoder_results",
    "epd_prompt",
    "pool_check",
]
