"""Load signals of every serving process, summed in the leader's autoscaler (issue 27).

The autoscaler runs in the process that leads the control plane (the parent of ``--workers N``, a
``control run`` replica, one of several frontends); the requests are served elsewhere — by its workers,
by the other frontends. So every serving process that does not lead runs a ``SignalReporter``: each
``every_s`` (and at once when a request is held for a scaled-to-zero endpoint: ``nudge``) it replaces
its rows in ``signal_reports`` (migration 0015) with its sampler's latest per-model sample — in flight,
queue, held, request rate, token rate. The leader's ``SignalSampler`` reads the fresh rows of every
other process through ``SignalPeers`` and adds them to its own samples, so the policy decides on the
load of all frontends and workers, and a request held on any of them is the leader's ``demand`` to wake.
A row older than ``stale_s`` (its process died or stalled) counts for nothing; the leader deletes rows
older than ``keep_s`` while its autoscaler reads them, and the retention job
(``retention_days["signal_reports"]``, server.control.registry.retention) deletes rows older than that
in any case — of processes gone while no leader read them. The gauges on /metrics stay each process's own (they are summed by Prometheus).

Each report also carries the desired-state generation the process has applied, so the leader can wait,
before it unloads an endpoint it scales to zero, until every reporting process holds that endpoint's
requests (``SignalPeers.lagging``): none is sent to a Triton that is unloading it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import BigInteger, Column, Engine, Float, MetaData, String, Table, delete, func, insert, select

from server.control.registry import retention
from server.control.rollout.arm_reports import ProcessReporter
from server.db import session_factory

metadata = MetaData()
signal_reports = Table(
    "signal_reports",
    metadata,
    Column("reporter", String(200), primary_key=True),
    Column("model", String(200), primary_key=True),
    Column("inflight", Float, nullable=False),
    Column("queue", Float, nullable=False),
    Column("held", Float, nullable=False),
    Column("qps", Float, nullable=False),
    Column("tokens_per_s", Float, nullable=False),
    Column("at", Float, nullable=False),
    Column("generation", BigInteger, nullable=False, server_default="0"),  # the desired state it has applied
)
PROCESS = ""  # the model of the row every reporter writes, models or not: its applied generation
SUMMED = ("inflight", "queue", "held", "qps", "tokens_per_s")


@dataclass
class PeerLoad:
    """What the other processes report for one model, summed."""

    inflight: float = 0.0
    queue: float = 0.0  # includes held, as a Sample's queue does
    held: float = 0.0
    qps: float = 0.0
    tokens_per_s: float = 0.0
    reporters: int = 0


class SignalReporter(ProcessReporter):
    """Its rows replace this process's earlier ones; a request held here ``nudge``s it: the leader should see the demand now."""

    what = "load signals"  # a failed write: the next report carries the then-current load

    def __init__(self, sampler, engine: Engine, reporter: str, every_s: float = 1.0, clock: Callable[[], float] = time.time,
                 wanted: set[str] | None = None, applied: Callable[[], int] = lambda: 0):  # fmt: skip
        super().__init__(engine, reporter, every_s, clock)
        self.sampler = sampler  # server.control.scaling.signals.SignalSampler (this process's own)
        self.applied = applied  # the desired-state generation this process has applied (its StateWatcher's)
        self.wanted = wanted if wanted is not None else set()  # scaled-to-zero endpoints a request here asked to wake

    def collect(self) -> list[dict]:
        at, generation = self._clock(), int(self.applied())
        rows = [{"reporter": self.reporter, "model": PROCESS, "inflight": 0.0, "queue": 0.0, "held": 0.0, "qps": 0.0, "tokens_per_s": 0.0,
                 "at": at, "generation": generation}]  # fmt: skip
        for model in sorted(set(self.sampler.models()) | self.wanted):
            latest = self.sampler.latest(model)
            held = float(self.sampler.own_held(model))  # now, not at the last sample: a nudge reports it at once
            if model in self.wanted:  # a wake was asked for here: one held request's worth of demand until it is served
                held = max(held, 1.0)
            row = {"reporter": self.reporter, "model": model, "inflight": 0.0, "queue": held, "held": held, "qps": 0.0, "tokens_per_s": 0.0, "at": at,
                   "generation": generation}  # fmt: skip
            if latest is not None:
                row.update(inflight=latest.inflight, queue=max(latest.queue, held), qps=latest.qps, tokens_per_s=latest.tokens_per_s)
            rows.append(row)
        return rows

    def write(self, rows: list[dict]) -> None:
        with self._session() as session:
            session.execute(delete(signal_reports).where(signal_reports.c.reporter == self.reporter))
            if rows:
                session.execute(insert(signal_reports), rows)
            session.commit()


class SignalPeers:
    """The leader's view of the other processes' reports (``SignalSampler.peers``)."""

    def __init__(self, engine: Engine, own: str, *, stale_s: float = 3.0, keep_s: float = 60.0, clock: Callable[[], float] = time.time):
        self._session = session_factory(engine)
        self.own = own  # this process's reporter id: its own rows (from when it stood by) are not a peer's
        self.stale_s = stale_s
        self.keep_s = keep_s
        self._clock = clock
        self._swept = 0.0

    def read(self) -> dict[str, PeerLoad]:
        now = self._clock()
        with self._session() as session:
            rows = session.execute(
                select(signal_reports).where(signal_reports.c.at >= now - self.stale_s, signal_reports.c.reporter != self.own)
            ).all()
            if now - self._swept >= self.keep_s / 10:  # the rows of processes gone, now and then (a write: not every round)
                session.execute(delete(signal_reports).where(signal_reports.c.at < now - self.keep_s))
                session.commit()
                self._swept = now
        out: dict[str, PeerLoad] = {}
        for row in rows:
            if row.model == PROCESS:
                continue
            load = out.setdefault(row.model, PeerLoad())
            for name in SUMMED:
                setattr(load, name, getattr(load, name) + float(getattr(row, name)))
            load.reporters += 1
        return out

    def lagging(self, generation: int) -> list[str]:
        """The reporting processes (fresh rows, not this one) that have not applied ``generation`` yet."""
        now = self._clock()
        with self._session() as session:
            rows = session.execute(
                select(signal_reports.c.reporter, func.max(signal_reports.c.generation))
                .where(signal_reports.c.at >= now - self.stale_s, signal_reports.c.reporter != self.own)
                .group_by(signal_reports.c.reporter)
            ).all()
        return sorted(reporter for reporter, applied in rows if int(applied) < generation)


def _at():
    return signal_reports.c.at


retention.register("signal_reports", lambda settings, keys: retention.Rows(settings.database_url, _at, as_datetime=False))
