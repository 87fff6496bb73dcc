"""Retention and deletion of what the platform stores: per-kind retention enforced by a background job,
and a tenant's stored data erased on request (``inferplane data purge --tenant T``).

Each kind of stored data is a *target* named by its ``retention_days`` key:

| target | what | erased by ``purge --tenant`` |
|---|---|---|
| ``usage`` | usage rows (``tenancy_usage``: billing counts, no payloads) | no |
| ``audit`` | the audit log (``audit_log``) | no (it records the erasure) |
| ``payload_logs`` | sampled requests and answers (``server.control.monitoring.payload_log``) | yes |
| ``shadow_records`` | disagreeing shadow copies (``server.control.rollout.shadow_records``) | yes |
| ``batch_files`` | batch jobs' input and output files (registered by the batch jobs' module) | yes |
| ``signal_reports`` | every process's latest load sample (``server.control.scaling.signal_reports``) | no |
| ``shadow_reports`` | every process's shadow counts (``server.control.rollout.shadow_reports``; a live shadow's rows are kept, registered by ``server.control.service.desired_state``) | no |

``INFERPLANE_RETENTION_DAYS='{"payload_logs": 30, "usage": 400}'``: a kind with no entry is kept
until deleted. The job runs every ``retention_interval_s`` in the process that runs the control plane
and writes one audit record per target it deleted something from.

**The hook**: a module that stores data of its own registers a target factory once, at import::

    from server.control.registry import retention

    class BatchFiles:                                     # anything with these two methods
        def purge_before(self, cutoff: float) -> int: ...   # delete what is older (unix seconds); how many
        def purge_tenant(self, tenant: str) -> int: ...     # delete everything of that tenant; how many

    retention.register("batch_files", lambda settings, keys: BatchFiles(settings, keys))

and names its module in :data:`PROVIDERS` (imported before the targets are built). ``keys`` is the
settings' :class:`server.control.registry.envelope.KeyRing` (or None): seal stored files with
``keys.encrypt_stream`` and open them with ``keys.decrypt_stream``. A ``purge_tenant`` that returns
None says the kind holds nothing to erase per tenant.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
import datetime as dt

from sqlalchemy import delete, select

from server import migrations
from server.db import make_engine
from server.tenancy.store import UsageRow
from server.control.registry.registry import AuditRecord
from server.control.registry.records import RecordFiles
from server.control.registry.envelope import KeyRing
from server.control.registry.audit_buffer import AuditWriter
from server.periodic import Periodic

log = logging.getLogger(__name__)

DAY_S = 86400.0
_FACTORIES: dict[str, Callable] = {}
# modules that register targets of their own (imported, when present, before the targets are built)
PROVIDERS: tuple[str, ...] = ("server.control.batches.batches", "server.control.scaling.signal_reports", "server.control.service.desired_state")


def register(name: str, factory: Callable) -> None:
    """``factory(settings, keys) -> target`` for the kind ``name`` (a ``retention_days`` key)."""
    _FACTORIES[name] = factory


# ---- the built-in targets ------------------------------------------------------------------------


class Rows:
    """Rows of one table older than a cutoff (``column()`` names the column, ORM or Core: float or datetime);
    ``keep(conn, old)`` may name, of the old rows' primary keys, those still in use (they stay)."""

    def __init__(self, url: str, column: Callable, as_datetime: bool, keep: Callable | None = None):
        self.url, self.column, self.as_datetime, self.keep = url, column, as_datetime, keep

    def purge_before(self, cutoff: float) -> int:
        engine = make_engine(self.url)
        try:
            migrations.upgrade(engine)
            column = self.column().expression
            value = dt.datetime.fromtimestamp(cutoff, dt.timezone.utc) if self.as_datetime else cutoff
            with engine.begin() as conn:
                if self.keep is None:
                    return conn.execute(delete(column.table).where(column < value)).rowcount or 0
                key = list(column.table.primary_key.columns)
                old = [tuple(r) for r in conn.execute(select(*key).where(column < value))]
                kept = self.keep(conn, old)
                gone = [k for k in old if k not in kept]
                for values in gone:
                    conn.execute(delete(column.table).where(*(c == v for c, v in zip(key, values))))
                return len(gone)
        finally:
            engine.dispose()

    def purge_tenant(self, tenant: str) -> None:
        return None  # counts and the audit trail, not payloads: kept (and the erasure is recorded here)


def _usage_ts():
    return UsageRow.ts


def _audit_at():
    return AuditRecord.at


def _record_files(destination_setting: str, prefix: str):
    def factory(settings, keys):
        return RecordFiles(getattr(settings, destination_setting), prefix, keys)

    return factory


register("usage", lambda s, keys: Rows(s.tenancy_url, _usage_ts, as_datetime=False))
register("audit", lambda s, keys: Rows(s.database_url, _audit_at, as_datetime=True))
register("payload_logs", _record_files("payload_log_destination", "payloads-"))
register("shadow_records", _record_files("shadow_record_destination", "shadow-"))


def _load_providers() -> None:
    for module in PROVIDERS:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise


def targets(settings, keys=None) -> dict[str, object]:
    """Every registered kind's target, built from the settings."""
    _load_providers()
    return {name: factory(settings, keys) for name, factory in sorted(_FACTORIES.items())}


def keys_for(settings):
    return KeyRing.from_settings(settings)


# ---- the two operations ---------------------------------------------------------------------------


@dataclass
class PassResult:
    target: str
    days: float
    removed: int


def enforce(settings, keys=None, now: float | None = None) -> list[PassResult]:
    """One retention pass: each kind with a ``retention_days`` entry loses what is older."""
    now = time.time() if now is None else now
    built = targets(settings, keys)
    results = []
    for name, days in sorted(settings.retention_days.items()):
        target = built.get(name)
        if target is None:
            continue  # a kind nobody stores here (no batch jobs module)
        try:
            removed = int(target.purge_before(now - days * DAY_S))
        except Exception as err:  # one unreachable store must not stop the others
            log.warning("retention of %s failed: %s", name, type(err).__name__)
            continue
        results.append(PassResult(name, days, removed))
    return results


def purge_tenant(settings, tenant: str, actor: str, keys=None, audit=None) -> dict[str, int | None]:
    """Erase ``tenant``'s stored payloads, shadow records and batch files; record it in the audit log.

    Returns per kind the records (or files) deleted, None where the kind holds nothing per tenant."""
    if not tenant:
        raise ValueError("name a tenant")
    counts: dict[str, int | None] = {}
    failed: dict[str, str] = {}
    for name, target in targets(settings, keys).items():
        try:
            counts[name] = target.purge_tenant(tenant)
        except Exception as err:  # noqa: BLE001 - recorded as a failed part of the erasure
            failed[name] = type(err).__name__
    erased = {k: v for k, v in counts.items() if v is not None}
    detail = ", ".join(f"{k}={v}" for k, v in sorted(erased.items())) or "nothing stored"
    if failed:
        detail += "; failed: " + ", ".join(f"{k} ({v})" for k, v in sorted(failed.items()))
    record = {"at": time.time(), "actor": actor, "action": "data.purge", "target": f"tenant:{tenant}", "outcome": "failed" if failed else "ok", "detail": detail}
    (audit or _audit_writer(settings))([record])
    if failed:
        raise RuntimeError(f"erasing tenant {tenant!r} failed for {', '.join(sorted(failed))} ({detail})")
    return counts


def _audit_writer(settings):
    writer = AuditWriter(settings.database_url)

    def write(records):
        try:
            return writer.write_many(records)
        finally:
            writer.close()

    return write


class RetentionJob:
    """The background job (``server.app``): a pass every ``retention_interval_s``, audited."""

    def __init__(self, settings, audit: Callable[[dict], None] | None = None):
        self.settings = settings
        self.audit = audit
        self.passes = 0
        self._keys = None
        interval = self.settings.retention_interval_s
        self._passes = Periodic("retention", interval, self._pass, first_s=min(60.0, interval))

    def start(self) -> None:
        self._passes.start()

    async def stop(self) -> None:
        await self._passes.stop()

    async def _pass(self) -> None:
        if self._keys is None:
            self._keys = keys_for(self.settings)
        await self.run_once(self._keys)

    async def run_once(self, keys=None) -> list[PassResult]:
        try:
            results = await asyncio.to_thread(enforce, self.settings, keys)
        except Exception:
            log.exception("retention pass failed")
            return []
        self.passes += 1
        for r in results:
            if r.removed and self.audit is not None:
                self.audit({
                    "at": time.time(), "actor": "retention", "action": "retention.purge", "target": r.target, "outcome": "ok",
                    "detail": f"deleted {r.removed} older than {r.days:g} days",
                })  # fmt: skip
            if r.removed:
                log.info("retention: deleted %d %s older than %g days", r.removed, r.target, r.days)
        return results
