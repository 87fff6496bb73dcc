"""Retention of the per-process report tables (``signal_reports``, migration 0015; ``shadow_reports``,
migration 0017): the leader's retention job deletes rows older than their ``retention_days`` and keeps
fresh ones — and a shadow's rows while the desired state still names that shadow — on SQLite and on a
real PostgreSQL."""

from __future__ import annotations

import asyncio
import time

import pytest
from sqlalchemy import insert, select

from server import migrations
from server.control.registry import retention
from server.control.rollout.shadow_reports import shadow_reports
from server.control.scaling.signal_reports import signal_reports
from server.control.service.desired_state import DesiredStateStore
from server.db import make_engine
from server.settings import Settings
from tests.conftest import fresh_postgres_database

DAY = 86400.0


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.service("postgresql"))])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/platform.db"
        return
    with fresh_postgres_database() as url:
        yield url


def _signal(reporter: str, model: str, at: float) -> dict:
    return {"reporter": reporter, "model": model, "inflight": 1.0, "queue": 0.0, "held": 0.0, "qps": 2.0, "tokens_per_s": 0.0, "at": at, "generation": 3}


def _shadow(reporter: str, endpoint: str, key: str, at: float) -> dict:
    return {"reporter": reporter, "endpoint": endpoint, "shadow": key, "stats": {"sent": 5, "compared": 5, "agreed": 5}, "at": at}


def test_the_retention_job_prunes_old_report_rows_and_keeps_fresh_ones_and_a_live_shadows(tmp_path, db_url):
    now = time.time()
    settings = Settings(data_dir=tmp_path, database_url=db_url, retention_days={"signal_reports": 1, "shadow_reports": 7})
    engine = make_engine(db_url)
    try:
        migrations.upgrade(engine)
        DesiredStateStore(engine).publish({"churn": {"live": "2", "split": None, "shadow": {"version": "3", "percent": 10.0, "key": "churn:3:a"}}})
        with engine.begin() as conn:
            conn.execute(insert(signal_reports), [_signal("gone/1", "m", now - 3 * DAY), _signal("gone/1", "", now - 3 * DAY), _signal("live/2", "m", now - 5)])
            conn.execute(insert(shadow_reports), [
                _shadow("a/1", "churn", "churn:2:old", now - 10 * DAY),  # an ended shadow's old row: pruned
                _shadow("a/1", "churn", "churn:3:a", now - 10 * DAY),  # the live shadow's idle process: kept
                _shadow("b/2", "churn", "churn:2:old", now - 1 * DAY),  # recent: kept
                _shadow("a/1", "gone", "gone:1:x", now - 30 * DAY),  # an endpoint with no desired state: pruned
            ])  # fmt: skip

        seen: list[dict] = []
        results = asyncio.run(retention.RetentionJob(settings, seen.append).run_once())

        removed = {r.target: r.removed for r in results}
        assert removed["signal_reports"] == 2 and removed["shadow_reports"] == 2
        with engine.connect() as conn:
            assert [tuple(r) for r in conn.execute(select(signal_reports.c.reporter, signal_reports.c.model))] == [("live/2", "m")]
            kept = sorted(tuple(r) for r in conn.execute(select(shadow_reports.c.reporter, shadow_reports.c.shadow)))
        assert kept == [("a/1", "churn:3:a"), ("b/2", "churn:2:old")]
        assert {(r["action"], r["target"]) for r in seen} == {("retention.purge", "signal_reports"), ("retention.purge", "shadow_reports")}
    finally:
        engine.dispose()


def test_the_report_tables_have_a_retention_by_default():
    days = Settings().retention_days
    assert days["signal_reports"] > 0 and days["shadow_reports"] > 0
