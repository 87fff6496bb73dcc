"""Canary and A/B metrics of every serving process, in the leader's windows (issue 27).

The traffic controller decides a canary's step or rollback from its router's per-arm windows; with the
control plane in another process (the parent of ``--workers N``, a ``control run`` replica) those see
none of the traffic. So every serving process that does not lead runs an ``ArmReporter``: each
``every_s`` it writes, per split arm, what its arm totals gained since the last report (requests,
errors, latency sum, the new latency samples) into ``arm_reports`` (migration 0010); the leader's
``ArmCollector`` reads the rows newer than the last it read and adds them to its own split's windows
and totals — the rollback decision then uses the outcomes of all frontends. A report is matched to
the split by its salt (the experiment / canary id), so a report of an ended split is dropped.

A/B feedback names a request by its id, and the Feedback RPC is carried to the leader, while the id → arm
map is filled where the request was answered. So a report also carries the request ids its process
answered for the arm since its last report, and ``absorb`` adds them to the leader's split; a Feedback
for an id the leader does not know yet reads the reports again for a few report intervals
(:func:`after_reports`) before it answers NOT_FOUND.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from sqlalchemy import JSON, Column, Engine, Float, Integer, MetaData, String, Table, delete, insert, select

from server.dataplane.routing import UnknownRequest
from server.db import session_factory

log = logging.getLogger(__name__)

MAX_SAMPLES = 200  # latency samples per arm per report
NOTHING_GAINED = {"requests": 0, "errors": 0, "latency_sum_s": 0.0, "samples": []}  # a report of request ids only
FEEDBACK_WAIT_S = 3.0  # a Feedback's wait for the report of its request: the reporter's 1 s, the collector's round, margin
FEEDBACK_POLL_S = 0.1  # how often a waiting Feedback reads the reports again
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
    latencies from the samples (their mean where the samples are fewer than the requests); its request ids
    are the arm's for feedback (the bound and eviction of ``Router.observe``)."""
    window, totals = split.windows.get(arm), split.totals.get(arm)
    if window is None or totals is None:
        return
    for request_id in outcomes.get("request_ids", ()):
        split.remember(request_id, arm)
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
    """Per split arm: what its totals gained and the request ids answered since the last report (each id
    reported once, in the order answered; at most MAX_FEEDBACK_IDS of them, the router's bound)."""

    what = "arm outcomes"  # _seen: (endpoint, salt, arm) -> the totals (requests, errors, latency sum, samples) reported

    def __init__(self, router, engine: Engine, reporter: str, every_s: float = 1.0, clock: Callable[[], float] = time.time):
        super().__init__(router, engine, reporter, every_s, clock)
        router.report_ids = True  # observe keeps each id for this report too (Split.unreported)

    def collect(self) -> list[dict]:
        rows = []
        for name, split in list(self.router.splits.items()):
            ids = split.drain_unreported()
            for arm, totals in split.totals.items():
                key = (name, split.salt, arm)
                delta = gained(totals, self._seen.get(key, (0, 0, 0.0, 0)))
                if delta is not None:
                    self._seen[key] = (totals.requests, totals.errors, totals.latency_sum_s, len(totals.latencies))
                if delta is None and arm not in ids:
                    continue
                outcomes = {**(delta or NOTHING_GAINED), "salt": split.salt}
                if arm in ids:
                    outcomes["request_ids"] = ids[arm]
                rows.append({"reporter": self.reporter, "endpoint": name, "arm": arm, "outcomes": outcomes, "at": self._clock()})
        return rows

    def write(self, rows: list[dict]) -> None:
        with self._session() as session:
            session.execute(insert(arm_reports), rows)
            session.commit()



class ArmCollector:
    """The leader's reader of ``arm_reports``: every ``every_s``, and at once for a waiting Feedback (:meth:`read_now`)."""

    def __init__(self, router, engine: Engine, every_s: float = 1.0, keep_s: float = 300.0, clock: Callable[[], float] = time.time):
        self.router = router
        self._session = session_factory(engine)
        self.every_s = every_s
        self.keep_s = keep_s
        self._clock = clock
        self.last_id: int | None = None  # None: a new leader reads only what is reported from now on
        self._reading = asyncio.Lock()  # one read at a time: two from the same last_id would absorb a report twice
        self._read_began = float("-inf")  # loop time the last read began

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

    async def read_now(self) -> None:
        """The reports written before this call, applied. Callers that wait while another read runs share the
        next one (a read that began after they asked is enough), so many waiting Feedbacks cost few reads."""
        loop = asyncio.get_running_loop()
        asked = loop.time()
        async with self._reading:
            if self._read_began >= asked:
                return
            self._read_began = loop.time()
            self.apply(await asyncio.to_thread(self._read))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.read_now()
            except Exception as err:
                log.warning("reading the arms' outcome reports failed: %s", err)


async def after_reports(attempt: Callable[[], str], collector: ArmCollector | None, wait_s: float = FEEDBACK_WAIT_S,
                        poll_s: float = FEEDBACK_POLL_S, clock: Callable[[], float] = time.monotonic) -> str:
    """``attempt()`` (a Feedback), tried again after each fresh read of the reports while it finds its request
    unknown (UnknownRequest) and ``wait_s`` has not passed: the process that answered the request reports its id
    within its ``every_s``, possibly after the outcome was sent. Without a collector (nothing reports to this
    process) the first answer stands. A failed read is logged and waited past like an empty one."""
    deadline = clock() + wait_s
    pause = 0.0  # the first read at once, then one every poll_s
    while True:
        try:
            return attempt()
        except UnknownRequest:
            if collector is None or clock() >= deadline:
                raise
        await asyncio.sleep(pause)
        pause = poll_s
        try:
            await collector.read_now()
        except Exception as err:
            log.warning("reading the arms' reports for a feedback failed: %s", err)
