"""Where each endpoint's scaling config lives: the registry database (table ``endpoint_scaling``,
migration 0006), beside the endpoint's deployments, so it survives a frontend restart; every
change is audited in the registry's audit log (action ``autoscale``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from sqlalchemy import JSON, Column, Float, MetaData, String, Table, delete, select

from server.db import session_factory, upsert

metadata = MetaData()
endpoint_scaling = Table(
    "endpoint_scaling",
    metadata,
    Column("endpoint", String(200), primary_key=True),
    Column("config", JSON, nullable=False),
    Column("actor", String(200), nullable=False),
    Column("updated_at", Float, nullable=False),
)


class ScalingStore:
    def __init__(self, registry, clock: Callable[[], float] = time.time):
        self.registry = registry  # server.control.registry.registry.Registry (migrated: the table exists)
        self._session = session_factory(registry.engine)
        self._clock = clock

    def put(self, endpoint: str, config: dict, actor: str = "") -> None:
        row = {"config": dict(config), "actor": actor or "unknown", "updated_at": self._clock()}
        with self._session() as session:
            upsert(session, endpoint_scaling, {"endpoint": endpoint}, row)
            session.commit()
        self.registry.audit(actor, "autoscale", endpoint, "ok", json.dumps(config, sort_keys=True))

    def get(self, endpoint: str) -> dict | None:
        with self._session() as session:
            row = session.execute(select(endpoint_scaling.c.config).where(endpoint_scaling.c.endpoint == endpoint)).first()
            return dict(row[0]) if row else None

    def all(self) -> dict[str, dict]:
        with self._session() as session:
            rows = session.execute(select(endpoint_scaling.c.endpoint, endpoint_scaling.c.config).order_by(endpoint_scaling.c.endpoint)).all()
            return {name: dict(config) for name, config in rows}

    def remove(self, endpoint: str, actor: str = "") -> None:
        with self._session() as session:
            session.execute(delete(endpoint_scaling).where(endpoint_scaling.c.endpoint == endpoint))
            session.commit()
        self.registry.audit(actor, "autoscale", endpoint, "ok", "removed")
