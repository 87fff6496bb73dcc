"""Shadow comparisons of every serving process, in the leader's shadow report (issue 27).

Every frontend worker copies its share of an endpoint's requests to the shadow version the desired
state names (server.control.service.state_watch applies it like a split), and compares the answers in
its own ``ShadowStats``. So every serving process that does not lead runs a ``ShadowReporter``: each
``every_s`` it writes, per shadow whose counts moved, its cumulative counts into ``shadow_reports``
(migration 0017) — one row per (process, endpoint, shadow key), replaced at each report, so a lost
report costs nothing but freshness. The leader's report (``TrafficController.shadow_report``) adds its
own counts to the rows of the same shadow key (``summed``): a report of another shadow of the same
endpoint (an earlier policy) is never mixed in.

The retention job (``retention_days["shadow_reports"]``, server.control.registry.retention) deletes the
rows older than that — except those of a shadow the desired state still names (a live shadow's idle
processes are not rewritten, and their counts are still part of its report): that rule reads the desired
state, so ``server.control.service.desired_state`` registers it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from sqlalchemy import JSON, Column, Engine, Float, MetaData, String, Table, delete, insert, select

from server.control.rollout.arm_reports import RouterReporter
from server.dataplane.routing import ShadowStats
from server.db import session_factory

MAX_SAMPLES = 1000  # latency deltas per process per shadow in a report
COUNTS = ("sent", "dropped", "errors", "paused", "compared", "agreed", "abs_diff_count")
metadata = MetaData()
shadow_reports = Table(
    "shadow_reports",
    metadata,
    Column("reporter", String(200), primary_key=True),
    Column("endpoint", String(200), primary_key=True),
    Column("shadow", String(300), primary_key=True),
    Column("stats", JSON, nullable=False),
    Column("at", Float, nullable=False),
)


def counts(stats: ShadowStats) -> dict:
    """A process's ShadowStats as the JSON a row keeps."""
    return {**{k: getattr(stats, k) for k in COUNTS}, "abs_diff_sum": stats.abs_diff_sum,
            "latency_deltas": stats.latency_deltas[:MAX_SAMPLES], "last_error": stats.last_error}  # fmt: skip


def summed(own: ShadowStats, reported: Iterable[dict]) -> ShadowStats:
    """``own`` plus every process's reported counts (a new ShadowStats; ``own`` is left as it is)."""
    out = ShadowStats(**{k: getattr(own, k) for k in COUNTS}, abs_diff_sum=own.abs_diff_sum,
                      latency_deltas=list(own.latency_deltas), last_error=own.last_error)  # fmt: skip
    for row in reported:
        for k in COUNTS:
            setattr(out, k, getattr(out, k) + int(row.get(k, 0)))
        out.abs_diff_sum += float(row.get("abs_diff_sum", 0.0))
        out.latency_deltas += list(row.get("latency_deltas", ()))
        out.last_error = out.last_error or row.get("last_error", "")
    return out


class ShadowReporter(RouterReporter):
    what = "shadow comparisons"  # _seen: (endpoint, shadow key) -> the counts last reported

    def collect(self) -> list[dict]:
        rows = []
        for name, shadow in list(self.router.shadows.items()):
            stats = shadow.stats
            mark = (*(getattr(stats, k) for k in COUNTS), stats.abs_diff_sum)
            if not shadow.key or self._seen.get((name, shadow.key)) == mark:
                continue
            self._seen[(name, shadow.key)] = mark
            rows.append({"reporter": self.reporter, "endpoint": name, "shadow": shadow.key, "stats": counts(stats), "at": self._clock()})
        return rows

    def write(self, rows: list[dict]) -> None:
        with self._session() as session:
            for row in rows:
                c = shadow_reports.c
                session.execute(delete(shadow_reports).where(c.reporter == row["reporter"], c.endpoint == row["endpoint"], c.shadow == row["shadow"]))
                session.execute(insert(shadow_reports).values(**row))
            session.commit()

    def _failed(self) -> None:
        self._seen.clear()  # the counts are cumulative: the next report carries them all again


class ShadowPeers:
    """What the leader reads: every process's reported counts of one shadow."""

    def __init__(self, engine: Engine):
        self._session = session_factory(engine)

    def reported(self, endpoint: str, key: str) -> list[dict]:
        with self._session() as session:
            c = shadow_reports.c
            return [dict(s) for s in session.execute(select(c.stats).where(c.endpoint == endpoint, c.shadow == key)).scalars()]
