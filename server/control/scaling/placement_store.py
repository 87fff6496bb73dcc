"""Where Triton placements live: the registry database (table ``triton_placements``, migration
0014), so every control-plane replica and every restart sees the same desired state.

A placement says "this Triton (or ``*``: every Triton) serves this model version"; ``config`` is an
optional JSON model config loaded with it (Triton's load-with-config), else the repository's
``config.pbtxt`` is used. ``remove`` keeps the row with ``removed_at`` set, so the reconciler can
keep the version loaded through its drain before unloading it; ``place`` again revives it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Column, Float, Integer, MetaData, String, Table, Text, delete, func, select, update

from server.db import session_factory, upsert

EVERY_TRITON = "*"

metadata = MetaData()
triton_placements = Table(
    "triton_placements",
    metadata,
    Column("model", String(200), primary_key=True),
    Column("version", Integer, primary_key=True),
    Column("triton", String(200), primary_key=True),
    Column("config", Text, nullable=True),
    Column("generation", Integer, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("removed_at", Float, nullable=True),
)


@dataclass(frozen=True)
class Placement:
    model: str
    version: int
    triton: str
    config: str | None
    generation: int
    removed_at: float | None

    def applies_to(self, triton_id: str) -> bool:
        return self.triton in (EVERY_TRITON, triton_id)


class PlacementStore:
    def __init__(self, engine, clock: Callable[[], float] = time.time):
        self.engine = engine  # migrated (the registry's engine): the table exists
        self._session = session_factory(engine)
        self._clock = clock

    def _generation(self, session, model: str) -> int:
        current = session.execute(select(func.max(triton_placements.c.generation)).where(triton_placements.c.model == model)).scalar()
        return (current or 0) + 1

    def place(self, model: str, version: int, triton: str = EVERY_TRITON, config: str | None = None) -> int:
        """Desire ``model`` version ``version`` on ``triton``; returns the model's new generation."""
        if version < 1:
            raise ValueError(f"a model version is >= 1, got {version}")
        with self._session() as session:
            generation = self._generation(session, model)
            row = {"config": config, "generation": generation, "updated_at": self._clock(), "removed_at": None}
            upsert(session, triton_placements, {"model": model, "version": version, "triton": triton}, row)
            session.commit()
        return generation

    def remove(self, model: str, version: int | None = None, triton: str = EVERY_TRITON) -> int:
        """No longer desire ``model`` (one version, or all) on ``triton``; returns how many placements
        were removed. The rows stay, marked removed (the reconciler drains, then unloads)."""
        where = [triton_placements.c.model == model, triton_placements.c.triton == triton, triton_placements.c.removed_at.is_(None)]
        if version is not None:
            where.append(triton_placements.c.version == version)
        with self._session() as session:
            generation = self._generation(session, model)
            now = self._clock()
            done = session.execute(update(triton_placements).where(*where).values(removed_at=now, updated_at=now, generation=generation)).rowcount
            session.commit()
        return done

    def set_versions(self, model: str, versions, triton: str = EVERY_TRITON) -> None:
        """Desire exactly ``versions`` of ``model`` on ``triton`` (the others removed: drained, unloaded)."""
        wanted = set(versions)
        placed = {p.version for p in self.all() if p.model == model and p.triton == triton and p.removed_at is None}
        for version in sorted(wanted - placed):
            self.place(model, version, triton)
        for version in sorted(placed - wanted):
            self.remove(model, version, triton)

    def hosts(self, model: str) -> set[str]:
        """The Tritons ``model`` is placed on by name (live placements; not ``*``)."""
        return {p.triton for p in self.all() if p.model == model and p.removed_at is None and p.triton != EVERY_TRITON}

    def place_versions(self, model: str, versions) -> None:
        """Desire exactly ``versions`` of ``model`` where it is placed: on each Triton that hosts it by name
        (the autoscaler chose them: server.control.scaling.remote_executor), else on every Triton."""
        for triton in sorted(self.hosts(model)) or [EVERY_TRITON]:
            self.set_versions(model, versions, triton)

    def set_hosts(self, model: str, versions, hosts, tritons) -> None:
        """Desire ``versions`` of ``model`` on exactly the Tritons ``hosts`` (by name), of all the Tritons
        ``tritons``: removed from every other one — the ``*`` placement too — so each of those has a
        removed row naming the model, and the reconciler unloads it there (after its drain) whoever
        loaded it."""
        hosts = set(hosts)
        rows = [p for p in self.all() if p.model == model]
        for triton in sorted(hosts):
            self.set_versions(model, versions, triton)
        for triton in sorted({p.triton for p in rows if p.removed_at is None} - hosts):
            self.set_versions(model, (), triton)
        for triton in sorted(set(tritons) - hosts - {p.triton for p in rows}):
            for version in sorted(set(versions)):  # never placed there: a removed row, so the reconciler knows it is not wanted
                self.place(model, version, triton)
                self.remove(model, version, triton)

    def all(self) -> list[Placement]:
        with self._session() as session:
            rows = session.execute(select(triton_placements).order_by(triton_placements.c.model, triton_placements.c.version)).all()
        return [Placement(r.model, r.version, r.triton, r.config, r.generation, r.removed_at) for r in rows]

    def forget_removed(self, before: float) -> int:
        """Delete the rows of placements removed before ``before`` (long unloaded everywhere)."""
        with self._session() as session:
            done = session.execute(delete(triton_placements).where(triton_placements.c.removed_at < before)).rowcount
            session.commit()
        return done
