"""Desired state in the database, versioned (issue 27): what every serving process applies to its pipeline.

One row per endpoint (table ``desired_state``, migration 0010): the live version and the traffic split
(kind, arms, sticky key header, salt, window), and its shadow (version, percent, key; migration 0017). ``generation`` comes from one counter over all endpoints,
so an endpoint's generation grows with each change and a watcher asks only for rows newer than the last
generation it applied. The leader is the only writer (``StatePublisher``, server.control.service.state_watch);
on PostgreSQL each publication also sends ``NOTIFY inferplane_desired`` (delivered at commit), which
the watchers LISTEN for; on SQLite they poll ``PRAGMA data_version``.

The leader's router (``server.dataplane.routing.Router``: routes, splits and shadows) is the source: the
deployer and the traffic controller switch it as before, and ``route_snapshot`` reads what to publish.
An endpoint the leader's autoscaler scaled to zero carries ``wake_budget_s`` (its cold-start budget)
while it sleeps: every serving process then holds its requests and reports them as demand
(server.control.scaling.signal_reports) until the leader has loaded it again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import JSON, BigInteger, Column, Engine, Float, MetaData, String, Table, func, select, text

from server.control.registry import retention
from server.control.rollout.shadow_reports import shadow_reports
from server.db import session_factory, upsert

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
    Column("wake_budget_s", Float, nullable=True),  # scaled to zero: its cold-start budget (migration 0015)
    Column("shadow", JSON, nullable=True),  # its shadow: shadow_state (migration 0017)
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


def shadow_state(shadow) -> dict[str, Any]:
    """A router Shadow as the JSON the row keeps (its comparison counts stay in the process that made them:
    server.control.rollout.shadow_reports carries them to the leader)."""
    return {"version": shadow.version, "percent": float(shadow.percent), "key": shadow.key}


def route_snapshot(router, asleep: Mapping[str, float] | None = None) -> dict[str, dict[str, Any]]:
    """Every endpoint the router knows: {endpoint: {"live": version | None, "split": split_state | None}}, with
    ``"shadow"`` (shadow_state) for each endpoint with a shadow, and ``"wake_budget_s"`` for each of ``asleep``
    (scaled to zero: endpoint -> cold-start budget)."""
    asleep = asleep or {}
    names = set(router.routes) | set(router.splits) | set(router.shadows) | set(asleep)
    out = {
        name: {"live": router.routes.get(name), "split": split_state(router.splits[name]) if name in router.splits else None}
        for name in sorted(names)
    }
    for name, shadow in router.shadows.items():
        out[name]["shadow"] = shadow_state(shadow)
    for name, budget in asleep.items():
        out[name]["wake_budget_s"] = float(budget)
    return out


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
                row = {"generation": generation, "live": state.get("live"), "split": state.get("split"), "updated_at": self._clock(),
                       "wake_budget_s": state.get("wake_budget_s"), "shadow": state.get("shadow")}  # fmt: skip
                upsert(session, desired_state, {"endpoint": name}, row)
            if self.postgres:
                session.execute(text("SELECT pg_notify(:channel, :payload)"), {"channel": CHANNEL, "payload": str(generation)})
            session.commit()
        return generation

    def since(self, generation: int) -> list[dict[str, Any]]:
        """Rows newer than ``generation``, oldest first."""
        with self._session() as session:
            rows = session.execute(
                select(desired_state.c.endpoint, desired_state.c.generation, desired_state.c.live, desired_state.c.split, desired_state.c.wake_budget_s,
                       desired_state.c.shadow)
                .where(desired_state.c.generation > generation)
                .order_by(desired_state.c.generation)
            ).all()
        return [{"endpoint": e, "generation": int(g), "live": live, "split": split, "wake_budget_s": wake, "shadow": shadow}
                for e, g, live, split, wake, shadow in rows]  # fmt: skip

    def all(self) -> dict[str, dict[str, Any]]:
        """Each endpoint's state as ``route_snapshot`` gives it (``shadow`` only with one, ``wake_budget_s`` only while asleep)."""
        out = {}
        for row in self.since(0):
            out[row["endpoint"]] = {"live": row["live"], "split": row["split"]}
            if row["shadow"] is not None:
                out[row["endpoint"]]["shadow"] = row["shadow"]
            if row["wake_budget_s"] is not None:
                out[row["endpoint"]]["wake_budget_s"] = row["wake_budget_s"]
        return out

    def generation(self) -> int:
        with self._session() as session:
            return int(session.execute(select(func.coalesce(func.max(desired_state.c.generation), 0))).scalar_one())


# ---- the shadow reports' retention: a live shadow's rows stay -------------------------------------


def _report_at():
    return shadow_reports.c.at


def live_shadows(conn, old: list[tuple]) -> set[tuple]:
    """Of the old ``shadow_reports`` rows' keys (reporter, endpoint, shadow), those of a shadow the desired state names now."""
    live = {(endpoint, (shadow or {}).get("key")) for endpoint, shadow in conn.execute(select(desired_state.c.endpoint, desired_state.c.shadow))}
    return {key for key in old if (key[1], key[2]) in live}


retention.register("shadow_reports", lambda settings, keys: retention.Rows(settings.database_url, _report_at, as_datetime=False, keep=live_shadows))
