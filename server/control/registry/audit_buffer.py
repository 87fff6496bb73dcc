"""Audit records written in batches, off the request path: safety-filter decisions, retention passes.

The request path only appends a dict to a bounded buffer (:meth:`AuditBuffer.add`); a background task
writes what accumulated every ``flush_s`` to the registry database's ``audit_log`` table, in one
transaction, from a thread. A full buffer drops the oldest record and counts it (the log line at the
next flush says how many); the database being away keeps the records for the next try.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable

from sqlalchemy.orm import Session

from server import migrations
from server.periodic import Buffer
from server.control.registry.registry import AuditRecord
from server.db import make_engine

log = logging.getLogger(__name__)


class AuditWriter:
    """Inserts audit rows into the platform database (engine opened, and migrated, at first use)."""

    def __init__(self, url: str):
        self.url = url
        self._engine = None

    def _open(self):
        if self._engine is None:

            engine = make_engine(self.url)
            migrations.upgrade(engine)
            self._engine = engine
        return self._engine

    def write_many(self, records: list[dict]) -> int:
        rows = [
            AuditRecord(
                at=dt.datetime.fromtimestamp(r.get("at") or 0, dt.timezone.utc), actor=str(r.get("actor") or "unknown")[:200],
                action=str(r["action"])[:64], target=str(r.get("target", ""))[:255], outcome=str(r.get("outcome", ""))[:16],
                detail=str(r.get("detail", ""))[:4000],
            )  # fmt: skip
            for r in records
        ]
        with Session(self._open()) as session, session.begin():
            session.add_all(rows)
        return len(rows)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None


class AuditBuffer(Buffer):
    """Records added on the request path, flushed every ``flush_s`` (``start()``), and once more at ``stop()``."""

    what = "audit records"

    def __init__(self, write_many: Callable[[list[dict]], int], flush_s: float = 2.0, capacity: int = 100_000):
        self.flush_s = flush_s
        self.written = 0
        super().__init__("audit-flush", flush_s, write_many, capacity)

    def add(self, record: dict) -> None:
        if len(self._pending) == self._pending.maxlen:
            self.dropped += 1
        self._pending.append(record)

    def _failed(self, batch: list[dict]) -> None:
        """The database is away: keep them for the next flush (when full, the oldest stay)."""
        self._pending.extendleft(reversed(batch))

    def _written(self, n: int) -> int:
        self.written += n
        if self.dropped:
            log.warning("audit buffer was full: %d records were dropped", self.dropped)
            self.dropped = 0
        return n
