"""Desired state in the database, versioned (issue 27): what every serving process applies to its pipeline.

One row per endpoint (table ``desired_state``, migration 0010): the live version and the traffic split
(kind, arms, sticky key header, salt, window). ``generation`` comes from one counter over all endpoints,
so an endpoint's generation grows with each change and a watcher asks only for rows newer than the last
generation it applied. The leader is the only writer (``StatePublisher``, server.control.service.state_watch);
on PostgreSQL each publication also sends ``NOTIFY inferplane_desired`` (delivered at commit), which
the watchers LISTEN for; on SQLite they poll ``PRAGMA data_version``.

The leader's router (``server.dataplane.routing.Router``: routes and splits) is the source: the
deployer and the traffic controller switch it as before, and ``route_snapshot`` reads what to publish.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import JSON, BigInteger, Column, Engine, Float, MetaData, String, Table, func, insert, select, text, update

from server.db import session_factory

CHANNEL = "inferplane_desired"
metadata = MetaData()
desired_state = Table(
    "desired_state",
    metadata,
    Column("endpoint", String(200), primary_key=True),
    Column("generation", BigInteger, nullable=False, index=True),
    Column("live", String(32), nullable=True),
    Column("split", JSON, nullable=True),
    Column("updated_at", Float, nullable=False),
)


def split_state(split) -> dict[str, Any]:
    """A router Split as the JSON the row keeps (its metrics stay in the process that measured them)."""
    return {
        "kind": split.kind,
        "arms": [[a.name, a.version, float(a.weight)] for a in split.arms],
        "key_header": split.key_header,
        "salt": split.salt,
        "window_s": float(split.window_s),
    }


def route_snapshot(router) -> dict[str, dict[str, Any]]:
    """Every endpoint the router knows: {endpoint: {"live": version | None, "split": split_state | None}}."""
    names = set(router.routes) | set(router.splits)
    return {
        name: {"live": router.routes.get(name), "split": split_state(router.splits[name]) if name in router.splits else None}
        for name in sorted(names)
    }


def changes(published: Mapping[str, dict], now: Mapping[str, dict]) -> dict[str, dict]:
    """What to publish: endpoints whose state differs; one that left the router publishes an empty state."""
    out = {name: state for name, state in now.items() if published.get(name) != state}
    for name in published:
        if name not in now and published[name] != {"live": None, "split": None}:
            out[name] = {"live": None, "split": None}
    return out


class DesiredStateStore:
    def __init__(self, engine: Engine, clock: Callable[[], float] = time.time):
        self.engine = engine
        self._session = session_factory(engine)
        self._clock = clock
        self.postgres = engine.dialect.name == "postgresql"

    def publish(self, states: Mapping[str, dict]) -> int:
        """Write each endpoint's state with a new generation, in one transaction; returns the last generation."""
        if not states:
            return self.generation()
        with self._session() as session:
            if self.postgres:  # one publisher at a time even while two processes both believe they lead
                session.execute(text("SELECT pg_advisory_xact_lock(hashtext(:k))"), {"k": CHANNEL})
            generation = session.execute(select(func.coalesce(func.max(desired_state.c.generation), 0))).scalar_one()
            for name, state in sorted(states.items()):
                generation += 1
                row = {"generation": generation, "live": state.get("live"), "split": state.get("split"), "updated_at": self._clock()}
                done = session.execute(update(desired_state).where(desired_state.c.endpoint == name).values(**row))
                if not done.rowcount:
                    session.execute(insert(desired_state).values(endpoint=name, **row))
            if self.postgres:
                session.execute(text("SELECT pg_notify(:channel, :payload)"), {"channel": CHANNEL, "payload": str(generation)})
            session.commit()
        return generation

    def since(self, generation: int) -> list[dict[str, Any]]:
        """Rows newer than ``generation``, oldest first."""
        with self._session() as session:
            rows = session.execute(
                select(desired_state.c.endpoint, desired_state.c.generation, desired_state.c.live, desired_state.c.split)
                .where(desired_state.c.generation > generation)
                .order_by(desired_state.c.generation)
            ).all()
        return [{"endpoint": e, "generation": int(g), "live": live, "split": split} for e, g, live, split in rows]

    def all(self) -> dict[str, dict[str, Any]]:
        return {row["endpoint"]: {"live": row["live"], "split": row["split"]} for row in self.since(0)}

    def generation(self) -> int:
        with self._session() as session:
            return int(session.execute(select(func.coalesce(func.max(desired_state.c.generation), 0))).scalar_one())
