"""Revision 0003 (tenancy tables) up and down, on an empty and on a populated database, and the
adoption of tables an earlier build made with ``create_all`` (SQLite always, PostgreSQL when
``INFERPLANE_TEST_POSTGRES_URL`` is set)."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from sqlalchemy import inspect, text

from server import migrations
from server.db import make_engine
from server.quota_policy import Quota
from server.tenancy import KeyRing
from server.tenancy_store import Base as TenancyBase
from server.tenancy_store import TenancyStore, UsageRecord
from tests.unit.test_registry import db_url  # noqa: F401 - a fixture

PEPPER = b"migration-pepper"
TENANCY_TABLES = {"tenancy_tenants", "tenancy_keys", "tenancy_usage"}


def _tables(engine) -> set[str]:
    return set(inspect(engine).get_table_names()) - {"alembic_version"}


def _populate(store: TenancyStore) -> str:
    store.create_key("acme", PEPPER, team="ml", plan="premium", models=["m1"], quota=Quota(rpm=10), admin=True)
    _, key = store.create_key("beta", PEPPER, models=["*"])
    store.write_usage([UsageRecord(time.time(), "acme", "ml", "m1", "1", 3, 7, 1500)])
    return key


def _check(store: TenancyStore, key: str) -> None:
    tenants = {t.name: t for t in store.tenants()}
    assert tenants["acme"].admin and tenants["acme"].models == frozenset({"m1"}) and tenants["acme"].quota == Quota(rpm=10)
    ring = KeyRing(PEPPER)
    ring.load(*store.snapshot())
    assert ring.authenticate(key).name == "beta"
    assert store.usage("tenant")[0] == {"tenant": "acme", "requests": 3, "tokens": 7, "compute_us": 1500}


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
