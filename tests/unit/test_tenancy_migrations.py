"""Revision 0003 (tenancy tables) up and down, on an empty and on a populated database, and the
adoption of tables an earlier build made with ``create_all``; revision 0005 (usage input/output
tokens) up and down over existing rows (SQLite always, PostgreSQL when
``INFERPLANE_TEST_POSTGRES_URL`` is set)."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from sqlalchemy import inspect, text

from server import migrations
from server.db import make_engine
from server.tenancy.quota_policy import Quota
from server.tenancy.identity import KeyRing
from server.tenancy.store import Base as TenancyBase
from server.tenancy.store import TenancyStore, UsageRecord
from tests.unit.test_registry import db_url  # noqa: F401 - a fixture

PEPPER = b"migration-pepper"
TENANCY_TABLES = {"tenancy_tenants", "tenancy_keys", "tenancy_usage"}


def _tables(engine) -> set[str]:
    return set(inspect(engine).get_table_names()) - {"alembic_version"}


def _populate(store: TenancyStore) -> str:
    store.create_key("acme", PEPPER, team="ml", plan="premium", models=["m1"], quota=Quota(rpm=10), admin=True)
    _, key = store.create_key("beta", PEPPER, models=["*"])
    store.write_usage([UsageRecord(time.time(), "acme", "ml", "m1", "1", 3, 7, 1500, input_tokens=5, output_tokens=2)])
    return key


def _check(store: TenancyStore, key: str) -> None:
    tenants = {t.name: t for t in store.tenants()}
    assert tenants["acme"].admin and tenants["acme"].models == frozenset({"m1"}) and tenants["acme"].quota == Quota(rpm=10)
    ring = KeyRing(PEPPER)
    ring.load(*store.snapshot())
    assert ring.authenticate(key).name == "beta"
    assert store.usage("tenant")[0] == {"tenant": "acme", "requests": 3, "input_tokens": 5, "output_tokens": 2, "tokens": 7, "compute_us": 1500}


def test_0003_up_and_down_on_an_empty_database(db_url):
    engine = make_engine(db_url)
    try:
        migrations.upgrade(engine, "0002")
        assert not _tables(engine) & TENANCY_TABLES
        migrations.upgrade(engine, "0003")
        assert migrations.current(engine) == "0003" and TENANCY_TABLES <= _tables(engine)
        migrations.downgrade(engine, "0002")
        assert migrations.current(engine) == "0002" and not _tables(engine) & TENANCY_TABLES
        migrations.downgrade(engine, "base")
        assert _tables(engine) == set()
    finally:
        engine.dispose()


def test_the_store_migrates_its_database_and_never_uses_create_all(db_url, monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("create_all must not be used: the schema comes from the migrations")

    monkeypatch.setattr(TenancyBase.metadata, "create_all", refuse)
    store = TenancyStore(db_url)
    try:
        assert migrations.current(store.engine) == migrations.head()
        _check(store, _populate(store))
        TenancyStore(db_url).close()  # opening it again is a no-op
    finally:
        store.close()


def test_0003_up_and_down_keep_the_data_of_a_populated_database(db_url):
    engine = make_engine(db_url)
    try:
        migrations.upgrade(engine, "0002")
        with engine.begin() as conn:  # registry data written before the tenancy revision
            conn.execute(text("INSERT INTO models (id, name, owner_team, description, created_at) VALUES (1, 'm1', 't', '', :now)"), {"now": datetime.now(UTC)})
        store = TenancyStore(db_url)  # upgrades 0002 -> 0003
        try:
            key = _populate(store)
            _check(store, key)
        finally:
            store.close()
        migrations.downgrade(engine, "0002")
        assert not _tables(engine) & TENANCY_TABLES
        with engine.connect() as conn:
            assert conn.execute(text("SELECT name FROM models")).scalars().all() == ["m1"]
        store = TenancyStore(db_url)
        try:
            assert store.tenants() == [] and store.keys() == []
            _check(store, _populate(store))
        finally:
            store.close()
        migrations.downgrade(engine, "base")
        assert _tables(engine) == set()
    finally:
        engine.dispose()


def test_0003_adopts_tables_an_earlier_build_created(db_url):
    """Before 0003 the store ran create_all on the registry's database: those tables and their rows stay."""
    engine = make_engine(db_url)
    try:
        migrations.upgrade(engine, "0002")
        TenancyBase.metadata.create_all(engine)
        legacy = TenancyStore(db_url, engine=engine, migrate=False)
        key = _populate(legacy)
        assert migrations.current(engine) == "0002"
        store = TenancyStore(db_url)
        try:
            assert migrations.current(store.engine) == migrations.head()  # 0003 or newer
            _check(store, key)
        finally:
            store.close()
        migrations.downgrade(engine, "0002")
        assert not _tables(engine) & TENANCY_TABLES
    finally:
        engine.dispose()


# ---- 0005: input and output tokens ---------------------------------------------------------------

USAGE_SPLIT = {"input_tokens", "output_tokens"}


def _usage_columns(engine) -> dict[str, dict]:
    return {c["name"]: c for c in inspect(engine).get_columns("tenancy_usage")}


def _insert_0004_row(engine, ts: float, tokens: int) -> None:
    """A usage row as a 0004 database holds it: one ``tokens`` count."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO tenancy_usage (ts, tenant, team, model, version, requests, tokens, compute_us) "
                "VALUES (:ts, 'acme', 'ml', 'llm', '1', 2, :tokens, 900)"
            ),
            {"ts": ts, "tokens": tokens},
        )


def test_0005_splits_tokens_and_keeps_the_rows_it_finds(db_url):
    engine = make_engine(db_url)
    try:
        migrations.upgrade(engine, "0004")
        assert not USAGE_SPLIT & set(_usage_columns(engine))
        _insert_0004_row(engine, 100.0, 40)
        migrations.upgrade(engine, "0005")
        columns = _usage_columns(engine)
        assert USAGE_SPLIT <= set(columns) and not any(columns[c]["nullable"] for c in USAGE_SPLIT)
        store = TenancyStore(db_url, engine=engine, migrate=False)
        # the old row keeps its total; which part was prompt is not known, so both read 0
        assert store.usage("tenant") == [{"tenant": "acme", "requests": 2, "input_tokens": 0, "output_tokens": 0, "tokens": 40, "compute_us": 900}]
        store.write_usage([UsageRecord(200.0, "acme", "ml", "llm", "1", 1, 12, 50, input_tokens=9, output_tokens=3)])
        assert store.usage("tenant") == [{"tenant": "acme", "requests": 3, "input_tokens": 9, "output_tokens": 3, "tokens": 52, "compute_us": 950}]
        _insert_0004_row(engine, 300.0, 5)  # a writer that does not know the columns: server default 0
        assert store.usage("tenant", since=250.0)[0]["input_tokens"] == 0
        migrations.downgrade(engine, "0004")
        assert migrations.current(engine) == "0004" and not USAGE_SPLIT & set(_usage_columns(engine))
        assert "ix_tenancy_usage_ts" in {i["name"] for i in inspect(engine).get_indexes("tenancy_usage")}
        with engine.connect() as conn:
            assert conn.execute(text("SELECT SUM(requests), SUM(tokens) FROM tenancy_usage")).one() == (5, 57)
        migrations.upgrade(engine, "head")
        assert store.usage("tenant")[0]["tokens"] == 57
    finally:
        engine.dispose()
