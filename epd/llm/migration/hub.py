"""`TransferHub`: one transfer engine and one `BlockMigrator` per LLM engine, shared by
every kind of block migration (E -> P image features, P -> D KV blocks).

Invariants:
- Created lazily (`start()`, idempotent) unless a role needs it at start (prefill and
  decode register the KV pool at once); `register_pool` starts it. Pools may be added
  after connections exist (the transfer engine hands them to existing endpoints).
- The migrator's events are drained once per engine step (`events()`), and every
  consumer gets all of them: each ignores the job ids it did not submit.
- `close()` stops the migrator, then closes the transfer engine (tearing endpoints down,
  so no read is in flight afterwards).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from epd.llm.migration.migrator import BlockMigrator, MigrationEvent

logger = logging.getLogger(__name__)


class TransferHub:
    def __init__(self, config: Any, *, notify: Callable[[], None] = lambda: None) -> None:
        self.config = config
        self._notify = notify
        self.transfer: Any = None
        self.migrator: BlockMigrator | None = None
        self.handshake: Any = None  # BlockMigrator handshake factory (None: HTTP)
        self._closed = False

    @property
    def started(self) -> bool:
        return self.migrator is not None

    def start(self) -> None:
        if self._closed:
            raise RuntimeError("the transfer hub is closed")
        if self.migrator is not None:
            return
        from epd.transfer import create_transfer_engine

        c = self.config
        transfer = create_transfer_engine(c.transfer, c.transfer_host, engine_id=c.engine_id)
        try:
            extra = {"handshake": self.handshake} if self.handshake is not None else {}
            self.migrator = BlockMigrator(transfer, notify=self._notify, **extra)
        except BaseException:
            transfer.close()
            raise
        self.transfer = transfer
        logger.info("transfer engine %s (%s) on %s", transfer.engine_id, transfer.name,
                    c.transfer_host)

    def set_handshake(self, factory: Any) -> None:
        """Use `factory` (a BlockMigrator handshake factory) for new connections, also
        once the migrator exists (tests connect engines in-process this way)."""
        self.handshake = factory
        if self.migrator is not None:
            self.migrator._handshake = factory

    def register_pool(self, name: str, tensor: Any) -> None:
        self.start()
        self.transfer.register_pool(name, tensor)

    def has_pool(self, name: str) -> bool:
        return self.transfer is not None and name in self.transfer.local_info()["pools"]

    def events(self) -> list[MigrationEvent]:
        return self.migrator.events() if self.migrator is not None else []

    def has_events(self) -> bool:
        return self.migrator is not None and self.migrator.has_events()

    def close(self) -> None:
        """Idempotent; the objects stay readable (counters) after closing."""
        if self.migrator is not None and not self._closed:
            self._closed = True
            self.migrator.close()
            self.transfer.close()
