"""Canary and A/B metrics of every serving process, in the leader's windows (issue 27).

The traffic controller decides a canary's step or rollback from its router's per-arm windows; with the
control plane in another process (the parent of ``--workers N``, a ``control run`` replica) those see
none of the traffic. So every serving process that does not lead runs an ``ArmReporter``: each
``every_s`` it writes, per split arm, what its arm totals gained since the last report (requests,
errors, latency sum, the new latency samples) into ``arm_reports`` (migration 0010); the leader's
``ArmCollector`` reads the rows newer than the last it read and adds them to its own split's windows
and totals — the rollback decision then uses the outcomes of all frontends. A report is matched to
the split by its salt (the experiment / canary id), so a report of an ended split is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from sqlalchemy import JSON, Column, Engine, Float, Integer, MetaData, String, Table, delete, insert, select

from server.db import session_factory

log = logging.getLogger(__name__)

MAX_SAMPLES = 200  # latency samples per arm per report
metadata = MetaData()
arm_reports = Table(
    "arm_reports",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("reporter", String(200), nullable=False),
    Column("endpoint", String(200), nullable=False),
    Column("arm", String(200), nullable=False),
    Column("outcomes", JSON, nullable=False),
    Column("at", Float, nullable=False),
)


def gained(totals, seen: tuple[int, int, float, int]) -> dict | None:
    """What an ArmTotals gained since ``seen`` (requests, errors, latency sum, samples kept); None: nothing."""
    requests, errors, latency_sum, kept = seen
    n = totals.requests - requests
    if n <= 0:
        return None
    samples = totals.latencies[kept:][:MAX_SAMPLES] if len(totals.latencies) > kept else []
    return {"requests": n, "errors": totals.errors - errors, "latency_sum_s": totals.latency_sum_s - latency_sum, "samples": samples}


def absorb(split, arm: str, outcomes: dict) -> None:
    """A report added to a split's window and totals: ``requests`` observations, the first ``errors`` failed,
    latencies from the samples (their mean where the samples are fewer than the requests)."""
    window, totals = split.windows.get(arm), split.totals.get(arm)
    if window is None or totals is None:
        return
    n, errors, samples = int(outcomes["requests"]), int(outcomes["errors"]), list(outcomes["samples"])
    mean = outcomes["latency_sum_s"] / n if n else 0.0
    for i in range(n):
        latency = samples[i] if i < len(samples) else mean
        window.add(latency, i < errors)
        totals.add(latency, i < errors)


class ProcessReporter:
    """What a serving process reports to the leader (arm outcomes here, shadow comparisons in
    server.control.rollout.shadow_reports, load signals in server.control.scaling.signal_reports): every
    ``every_s`` (and at once after ``nudge()``) the rows ``collect()`` gives, written off the event loop by
    ``write``; a failed write (the database is away) is logged and ``_failed()`` runs."""

    what = "reports"

    def __init__(self, engine: Engine, reporter: str, every_s: float = 1.0, clock: Callable[[], float] = time.time):
        self._session = session_factory(engine)
        self.reporter = reporter
        self.every_s = every_s
        self._clock = clock
        self._now = asyncio.Event()

    def nudge(self) -> None:
        """Report at once."""
        self._now.set()

    def collect(self) -> list[dict]:
        raise NotImplementedError

    def write(self, rows: list[dict]) -> None:
        raise NotImplementedError

    def _failed(self) -> None:
        """A write failed: what is reported as deltas is lost, and the next ones go."""

    async def run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._now.wait(), self.every_s)
            except asyncio.TimeoutError:
                pass
            self._now.clear()
            rows = self.collect()
            if rows:
                try:
                    await asyncio.to_thread(self.write, rows)
                except Exception as err:
                    log.warning("reporting %s failed: %s", self.what, err)
                    self._failed()


class RouterReporter(ProcessReporter):
    """A report of the router's splits or shadows; ``_seen``: what was reported last, per reported thing."""

    def __init__(self, router, engine: Engine, reporter: str, every_s: float = 1.0, clock: Callable[[], float] = time.time):
        super().__init__(engine, reporter, every_s, clock)
        self.router = router
        self._seen: dict = {}


class ArmReporter(RouterReporter):
    what = "arm outcomes"  # _seen: (endpoint, salt, arm) -> the totals (requests, errors, latency sum, samples) reported

    def collect(self) -> list[dict]:
        rows = []
        for name, split in list(self.router.splits.items()):
            for arm, totals in split.totals.items():
                key = (name, split.salt, arm)
                delta = gained(totals, self._seen.get(key, (0, 0, 0.0, 0)))
                if delta is not None:
                    self._seen[key] = (totals.requests, totals.errors, totals.latency_sum_s, len(totals.latencies))
                    rows.append({"reporter": self.reporter, "endpoint": name, "arm": arm, "outcomes": {**delta, "salt": split.salt}, "at": self._clock()})
        return rows

    def write(self, rows: list[dict]) -> None:
        with self._session() as session:
            session.execute(insert(arm_reports), rows)
            session.commit()



class ArmCollector:
    def __init__(self, router, engine: Engine, every_s: float = 1.0, keep_s: float = 300.0, clock: Callable[[], float] = time.time):
        self.router = router
        self._session = session_factory(engine)
        self.every_s = every_s
        self.keep_s = keep_s
        self._clock = clock
        self.last_id: int | None = None  # None: a new leader reads only what is reported from now on

    def _read(self) -> list:
        with self._session() as session:
            if self.last_id is None:
                self.last_id = int(session.execute(select(arm_reports.c.id).order_by(arm_reports.c.id.desc()).limit(1)).scalar() or 0)
                return []
            rows = session.execute(select(arm_reports).where(arm_reports.c.id > self.last_id).order_by(arm_reports.c.id)).all()
            session.execute(delete(arm_reports).where(arm_reports.c.at < self._clock() - self.keep_s))
            session.commit()
        return rows

    def apply(self, rows) -> int:
        used = 0
        for row in rows:
            self.last_id = max(self.last_id or 0, row.id)
            split = self.router.splits.get(row.endpoint)
            if split is not None and split.salt == row.outcomes.get("salt"):
                absorb(split, row.arm, row.outcomes)
                used += 1
        return used

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                self.apply(await asyncio.to_thread(self._read))
            except Exception as err:
                log.warning("reading the arms' outcome reports failed: %s", err)
