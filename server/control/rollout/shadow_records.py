"""Shadow records: the request and both answers of every shadow copy whose answers disagreed.

A shadow (``inferplane shadow start NAME:VER``) compares the shadow version's answer with the one the
caller got; its report counts agreement. Counts say *that* they differ; the records say *where*: each
disagreement is kept (request, primary answer, shadow answer, as the protobuf bytes, base64) up to
``shadow_record_max`` per shadow in each serving process (every frontend worker copies its share), in
``INFERPLANE_SHADOW_RECORD_DESTINATION`` (``DATA_DIR/shadow_records``),
sealed with the encryption key when one is set, deleted after ``retention_days["shadow_records"]``
and by ``inferplane data purge --tenant``. Writing happens off the event loop, in batches.
"""

from __future__ import annotations

import datetime as dt
import os

from server.periodic import Buffer
from server.control.registry.envelope import seal_line
from server.control.registry.records import RecordFiles

PREFIX = "shadow-"


class ShadowRecords(Buffer):
    """Disagreements kept by each shadow's recorder, written every ``flush_s`` (``start()``), and once more at ``stop()``."""

    what = "shadow records"

    def __init__(self, destination: str, keys=None, max_per_shadow: int = 1000, flush_s: float = 1.0):
        self.files = RecordFiles(destination, PREFIX, keys)
        self.keys = keys
        self.max_per_shadow = max_per_shadow
        self.flush_s = flush_s
        self._counts: dict[str, int] = {}
        super().__init__("shadow-records", flush_s, self._write, 10_000)  # a failed write: the batch is lost (counted)

    def recorder(self, endpoint: str, version: str):
        """What a :class:`server.dataplane.routing.Shadow` calls with each disagreement."""
        key = f"{endpoint}:{version}"
        self._counts[key] = 0

        def record(doc: dict) -> None:
            if self._counts.get(key, 0) >= self.max_per_shadow:
                self.dropped += 1
                return
            self._counts[key] = self._counts.get(key, 0) + 1
            self._pending.append({**doc, "model": endpoint})

        return record

    def _write(self, batch: list[dict]) -> None:
        lines = [seal_line(self.keys, doc) for doc in batch]
        day = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d")
        name = f"{PREFIX}{day}-{os.getpid()}.jsonl" if self.files.local else f"{PREFIX}{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%S%f}.jsonl"
        self.files.append(lines, name)

    def read(self, tenant: str | None = None) -> list[dict]:
        return list(self.files.read(tenant))
