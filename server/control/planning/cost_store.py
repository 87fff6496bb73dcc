"""What cost is computed from, in the registry database (migration 0011):

- ``replica_intervals``: one row per (replica, endpoint) from the moment the replica reserved capacity
  for the endpoint until it let it go (``ended_at`` NULL while it still does), with the replica's
  hardware class, capacity type (on_demand | spot) and the endpoint's memory on it (the share key when
  replicas are shared). The owner view of cost is these intervals x the price list.
- ``cost_budgets``: a monthly budget per team or endpoint, with its hard action at 100 %
  (``none`` | ``refuse_deploys`` | ``cap_replicas``). Every change is an ``audit_log`` row (action ``budget``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import BigInteger, Column, Float, Index, Integer, MetaData, String, Table, and_, delete, insert, or_, select, update

from server.db import session_factory, upsert

metadata = MetaData()
replica_intervals = Table(
    "replica_intervals",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("replica", String(200), nullable=False),
    Column("endpoint", String(200), nullable=False),
    Column("hardware", String(64), nullable=False),
    Column("capacity_type", String(16), nullable=False),
    Column("memory_bytes", BigInteger, nullable=False),
    Column("started_at", Float, nullable=False),
    Column("ended_at", Float, nullable=True),
    Index("ix_replica_intervals_endpoint", "endpoint"),
    Index("ix_replica_intervals_started_at", "started_at"),
)
cost_budgets = Table(
    "cost_budgets",
    metadata,
    Column("scope", String(16), primary_key=True),
    Column("name", String(200), primary_key=True),
    Column("amount_usd", Float, nullable=False),
    Column("hard_action", String(32), nullable=False),
    Column("actor", String(200), nullable=False),
    Column("updated_at", Float, nullable=False),
)

SCOPES = ("team", "endpoint")
HARD_ACTIONS = ("none", "refuse_deploys", "cap_replicas")


@dataclass(frozen=True)
class Interval:
    replica: str
    endpoint: str
    hardware: str
    capacity_type: str
    memory_bytes: int
    started_at: float
    ended_at: float | None = None  # None: still reserved


@dataclass(frozen=True)
class Budget:
    scope: str  # team | endpoint
    name: str
    amount_usd: float
    hard_action: str = "none"


class CostStore:
    def __init__(self, registry, clock: Callable[[], float] = time.time):
        self.registry = registry  # server.control.registry.registry.Registry (migrated: the tables exist)
        self._session = session_factory(registry.engine)
        self._clock = clock

    # ---- replica intervals --------------------------------------------------------------

    def replica_up(
        self, replica: str, endpoint: str, *, hardware: str, capacity_type: str = "on_demand", memory_bytes: int = 0, at: float | None = None
    ) -> bool:
        """Open an interval for ``endpoint`` on ``replica``; False when one is open already."""
        at = self._clock() if at is None else at
        with self._session() as session:
            open_row = session.execute(
                select(replica_intervals.c.id).where(
                    replica_intervals.c.replica == replica, replica_intervals.c.endpoint == endpoint, replica_intervals.c.ended_at.is_(None)
                )
            ).first()
            if open_row is not None:
                return False
            session.execute(
                insert(replica_intervals).values(
                    replica=replica, endpoint=endpoint, hardware=hardware, capacity_type=capacity_type,
                    memory_bytes=int(memory_bytes), started_at=at, ended_at=None,
                )
            )  # fmt: skip
            session.commit()
        return True

    def replica_down(self, replica: str, endpoint: str | None = None, at: float | None = None) -> int:
        """Close the open intervals of ``replica`` (for ``endpoint``, or every endpoint on it)."""
        at = self._clock() if at is None else at
        where = [replica_intervals.c.replica == replica, replica_intervals.c.ended_at.is_(None)]
        if endpoint is not None:
            where.append(replica_intervals.c.endpoint == endpoint)
        with self._session() as session:
            done = session.execute(update(replica_intervals).where(*where).values(ended_at=at))
            session.commit()
            return done.rowcount

    def set_replica_count(
        self, endpoint: str, count: int, *, hardware: str, capacity_type: str = "on_demand", memory_bytes: int = 0, at: float | None = None
    ) -> None:
        """An endpoint of ``count`` dedicated replicas ``ENDPOINT#0..count-1``: open or close slots to match."""
        open_now = {r for r in self.open_replicas(endpoint) if r.startswith(f"{endpoint}#")}
        want = {f"{endpoint}#{i}" for i in range(max(0, count))}
        for replica in sorted(open_now - want):
            self.replica_down(replica, endpoint, at)
        for replica in sorted(want - open_now):
            self.replica_up(replica, endpoint, hardware=hardware, capacity_type=capacity_type, memory_bytes=memory_bytes, at=at)

    def open_replicas(self, endpoint: str) -> list[str]:
        with self._session() as session:
            rows = session.execute(
                select(replica_intervals.c.replica).where(replica_intervals.c.endpoint == endpoint, replica_intervals.c.ended_at.is_(None))
            ).all()
        return sorted(r[0] for r in rows)

    def open_pairs(self) -> set[tuple[str, str]]:
        """(replica, endpoint) of every interval still open."""
        c = replica_intervals.c
        with self._session() as session:
            return {(r, e) for r, e in session.execute(select(c.replica, c.endpoint).where(c.ended_at.is_(None))).all()}

    def intervals(self, since: float, until: float) -> list[Interval]:
        """Every interval that overlaps [since, until)."""
        c = replica_intervals.c
        q = select(c.replica, c.endpoint, c.hardware, c.capacity_type, c.memory_bytes, c.started_at, c.ended_at).where(
            c.started_at < until, or_(c.ended_at.is_(None), and_(c.ended_at > since))
        )
        with self._session() as session:
            return [Interval(*row) for row in session.execute(q.order_by(c.replica, c.started_at)).all()]

    # ---- budgets ------------------------------------------------------------------------

    def set_budget(self, budget: Budget, actor: str = "") -> None:
        if budget.scope not in SCOPES:
            raise ValueError(f"budget scope must be one of {', '.join(SCOPES)}")
        if budget.hard_action not in HARD_ACTIONS:
            raise ValueError(f"hard action must be one of {', '.join(HARD_ACTIONS)}")
        if budget.amount_usd <= 0:
            raise ValueError("a budget is a positive amount of USD")
        row = {"amount_usd": float(budget.amount_usd), "hard_action": budget.hard_action, "actor": actor or "unknown", "updated_at": self._clock()}
        with self._session() as session:
            upsert(session, cost_budgets, {"scope": budget.scope, "name": budget.name}, row)
            session.commit()
        self.registry.audit(actor, "budget", f"{budget.scope}:{budget.name}", "ok", f"set {budget.amount_usd:.2f} USD/month, hard action {budget.hard_action}")

    def remove_budget(self, scope: str, name: str, actor: str = "") -> bool:
        c = cost_budgets.c
        with self._session() as session:
            done = session.execute(delete(cost_budgets).where(c.scope == scope, c.name == name))
            session.commit()
        if done.rowcount:
            self.registry.audit(actor, "budget", f"{scope}:{name}", "ok", "removed")
        return bool(done.rowcount)

    def budgets(self) -> list[Budget]:
        c = cost_budgets.c
        with self._session() as session:
            rows = session.execute(select(c.scope, c.name, c.amount_usd, c.hard_action).order_by(c.scope, c.name)).all()
        return [Budget(*row) for row in rows]
