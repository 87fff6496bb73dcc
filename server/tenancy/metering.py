"""Usage metering: every answered request (and every generation the LLM engine worked on, however
it ended) is counted in memory, written to the DB in batches.

The hot path does one dict update (:meth:`Meter.record`); a background task flushes the sums
every ``flush_s`` seconds as one ``tenancy_usage`` row per (tenant, team, model, version) and
period, through ``asyncio.to_thread`` — never on the request path. A failed write keeps the sums
for the next flush; ``stop()`` flushes what is left.

``compute_us`` is the Triton service time the frontend observed for the request (from the
moment it left the admission gate to its answer; for LLM generation, while the engine had it).
``input_tokens`` / ``output_tokens`` are an LLM request's prompt and completion tokens (an
embedding request's input tokens); ``tokens`` is their sum, the only count rows written before
revision 0005 carry. Reports: :func:`usage_report` (by tenant, team or model since a time); cost (owner and caller
views, priced from the versioned price list) is ``server.control.planning.cost_reports``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from datetime import datetime, timezone

from server.periodic import Periodic
from server.tenancy.store import TenancyStore, UsageRecord

log = logging.getLogger(__name__)

# USD per device-hour (CPU: per core-hour). Illustrative list prices; pass your own table.
DEFAULT_PRICES: dict[str, float] = {
    "cpu": 0.04,
    "t4": 0.35,
    "l4": 0.80,
    "a10g": 1.01,
    "a100": 3.67,
    "h100": 6.98,
    "h200": 8.50,
}


class Meter(Periodic):
    """Sums per (tenant, team, model, version, traffic class), written every ``flush_s`` (``start()``), and once more at ``stop()``."""

    def __init__(self, write: Callable[[list[UsageRecord]], int] | None, flush_s: float = 5.0, clock: Callable[[], float] = time.time):
        self._write = write
        self.flush_s = flush_s
        self._clock = clock
        self._sums: dict[tuple[str, str, str, str], list[int]] = {}
        self._period_start = clock()
        super().__init__("usage-flush", flush_s, self.flush, final=True)
        self.written = 0
        self.failures = 0

    # ---- hot path -------------------------------------------------------------------------

    def record(
        self, tenant: str, team: str, model: str, version: str, *, input_tokens: int = 0, output_tokens: int = 0, compute_us: int = 0,
        traffic_class: str = "realtime",
    ) -> None:
        key = (tenant, team, model, version, traffic_class)  # a batch job's rows are metered apart
        sums = self._sums.get(key)
        if sums is None:
            self._sums[key] = [1, input_tokens, output_tokens, compute_us]
        else:
            sums[0] += 1
            sums[1] += input_tokens
            sums[2] += output_tokens
            sums[3] += compute_us

    # ---- batches --------------------------------------------------------------------------

    def drain(self) -> list[UsageRecord]:
        sums, self._sums = self._sums, {}
        ts, self._period_start = self._period_start, self._clock()
        return [
            UsageRecord(ts, t, team, m, v, r, inp + out, us, input_tokens=inp, output_tokens=out, traffic_class=c)
            for (t, team, m, v, c), (r, inp, out, us) in sums.items()
        ]

    def _restore(self, records: list[UsageRecord]) -> None:
        for r in records:
            sums = self._sums.setdefault((r.tenant, r.team, r.model, r.version, r.traffic_class), [0, 0, 0, 0])
            sums[0] += r.requests
            sums[1] += r.input_tokens
            sums[2] += r.output_tokens
            sums[3] += r.compute_us

    async def flush(self) -> int:
        records = self.drain()
        if not records or self._write is None:
            return 0
        try:
            n = await asyncio.to_thread(self._write, records)
        except Exception as err:  # the database is away: keep the sums, try again next time
            self.failures += 1
            self._restore(records)
            log.warning("usage flush of %d records failed (%s); kept for the next flush", len(records), err)
            return 0
        self.written += n
        return n


# ---- reports ------------------------------------------------------------------------------

_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_since(text: str, now: float | None = None) -> float:
    """``1h``, ``30m``, ``7d`` (ago), an ISO date/time, or unix seconds -> unix seconds."""
    now = time.time() if now is None else now
    text = text.strip()
    m = _RELATIVE.match(text)
    if m:
        return now - float(m.group(1)) * _UNIT_S[m.group(2)]
    try:
        return float(text)
    except ValueError:
        pass
    dt = datetime.fromisoformat(text)
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def usage_report(store: TenancyStore, by: str, since: float, until: float | None = None) -> list[dict]:
    rows = store.usage(by, since, until)
    for r in rows:
        r["compute_s"] = round(r.pop("compute_us") / 1e6, 6)
    return rows
