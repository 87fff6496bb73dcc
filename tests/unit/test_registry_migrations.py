"""Alembic migrations up and down, on an empty and on a populated database (SQLite and PostgreSQL)."""

from __future__ import annotations

from datetime import UTC, datetime

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from server import migrations
from server.control.registry.artifacts import ArtifactStore
from server.db import make_engine
from server.control.registry.registry import Base, Registry
from server.tenancy.store import Base as TenancyBase
from server.control.scaling.scaling_store import metadata as scaling_metadata
from server.control.rollout.traffic import metadata as traffic_metadata
from server.control.typed.typed_store import metadata as typed_metadata
from server.control.batches.batches import _meta as batches_metadata
from server.control.scaling.placement_store import metadata as placement_metadata
from server.control.planning.cost_store import metadata as cost_metadata
from server.control.service.desired_state import metadata as desired_metadata
from server.control.service.leader import metadata as leader_metadata
from server.control.rollout.arm_reports import metadata as arm_metadata
from server.control.scaling.signal_reports import metadata as signal_metadata
from server.control.rollout.shadow_reports import metadata as shadow_metadata
from tests.unit.test_registry import SIGNATURE, db_url, lightgbm  # noqa: F401 - db_url is a fixture

V1_TABLES = {"models", "model_versions", "audit_log"}
V2_TABLES = V1_TABLES | {"trusted_keys", "team_policies", "deployments"}
HEAD_TABLES = V2_TABLES | {"tenancy_tenants", "tenancy_keys", "tenancy_usage"}  # 0003: tests/unit/test_tenancy_migrations.py
HEAD_TABLES |= {"traffic_policies"}  # 0004: server/traffic.py
HEAD_TABLES |= {"typed_schemas"}  # 0006: server/control/typed/typed_store.py
HEAD_TABLES |= {"endpoint_scaling"}  # 0007: server/control/scaling/scaling_store.py
HEAD_TABLES |= {"composite_members", "batch_files", "batch_jobs", "batch_rows"}  # 0008: server/control/composition/composites.py, batches.py
HEAD_TABLES |= {"tenancy_identities"}  # 0009: server/tenancy/store.py (mTLS certificate bindings)
HEAD_TABLES |= {"desired_state", "control_lease", "arm_reports"}  # 0010: server/control/service/desired_state.py, leader.py, arm_reports.py (issue 27)
HEAD_TABLES |= {"replica_intervals", "cost_budgets"}  # 0011: server/control/planning/cost_store.py
HEAD_TABLES |= {"triton_placements"}  # 0014: server/control/scaling/placement_store.py (the Triton reconciler's desired state)
HEAD_TABLES |= {"signal_reports"}  # 0015: server/control/scaling/signal_reports.py (every serving process's load signals)
HEAD_TABLES |= {"shadow_reports"}  # 0017: server/control/rollout/shadow_reports.py (every serving process's shadow comparisons)


def _tables(engine) -> set[str]:
    return set(inspect(engine).get_table_names()) - {"alembic_version"}


def test_up_and_down_on_an_empty_database(db_url):
    engine = make_engine(db_url)
    try:
        assert migrations.current(engine) is None
        migrations.upgrade(engine)
        assert migrations.current(engine) == migrations.head() and _tables(engine) == HEAD_TABLES
        migrations.downgrade(engine, "0001")
        assert migrations.current(engine) == "0001" and _tables(engine) == V1_TABLES
        migrations.downgrade(engine, "base")
        assert migrations.current(engine) is None and _tables(engine) == set()
        migrations.upgrade(engine)
        assert _tables(engine) == HEAD_TABLES
    finally:
        engine.dispose()


def test_the_models_match_the_newest_migration(db_url):
    engine = make_engine(db_url)
    try:
        migrations.upgrade(engine)
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": False}), [Base.metadata, TenancyBase.metadata, traffic_metadata, typed_metadata, scaling_metadata, batches_metadata, placement_metadata, cost_metadata, desired_metadata, leader_metadata, arm_metadata, signal_metadata, shadow_metadata])
        assert diff == []
    finally:
        engine.dispose()


def test_up_and_down_keep_the_data_of_a_populated_database(db_url, tmp_path):
    engine = make_engine(db_url)
    store = ArtifactStore(tmp_path / "artifacts")
    artifact = lightgbm(2)
    digest = store.put(artifact)
    try:
        migrations.upgrade(engine, "0001")
        now = datetime.now(UTC)
        with engine.begin() as conn:  # a version written by the first schema
            conn.execute(text("INSERT INTO models (id, name, owner_team, description, created_at) VALUES (1, 'm', 't', '', :now)"), {"now": now})
            conn.execute(
                text(
                    "INSERT INTO model_versions (id, model_id, version, sha256, format, framework, artifact_name, size_bytes, "
                    "signature, companions, metrics, hardware, tags, created_at) VALUES (1, 1, 1, :sha, 'lightgbm-text', "
                    "'lightgbm', 'model.txt', :size, :sig, '{}', '{}', '{}', '{}', :now)"
                ),
                {"sha": digest, "size": len(artifact), "sig": __import__("json").dumps(SIGNATURE), "now": now},
            )
        migrations.upgrade(engine)
        registry = Registry(db_url, store, migrate=False)
        try:
            old = registry.get("m", 1)
            assert old.sha256 == digest and old.artifact_signature is None and old.owner_team == "t"
            assert old.content_sha256 == digest  # 0016 filled it in: a version without companions is its artifact
            v2, created = registry.register("m", lightgbm(3), signature=SIGNATURE, parent="m:1")
            assert created and v2.version == 2
            registry.record_deployment("m", "m", 2, {}, "alice")
            again, created = registry.register("m", artifact, signature=SIGNATURE)
            assert not created and again.version == 1
        finally:
            registry.close()
        migrations.downgrade(engine, "0001")
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version FROM model_versions ORDER BY version")).scalars().all() == [1, 2]
        assert "deployments" not in _tables(engine)
        migrations.upgrade(engine)
        registry = Registry(db_url, store)
        try:
            assert [r.ref for r in registry.lineage("m", 2)] == ["m:2", "m:1"]
        finally:
            registry.close()
        migrations.downgrade(engine, "base")
        assert _tables(engine) == set()
    finally:
        engine.dispose()


def test_the_content_digest_migration_fills_in_what_the_registry_computes():
    """0016 keeps its own copy of the digest (a migration does not import the code it migrates for)."""
    import importlib

    from server.control.registry.artifacts import content_digest

    frozen = importlib.import_module("server.migrations.versions.0016_version_content_digest").content_digest
    companions = {"tokenizer.json": "ab" * 32, "config.json": "cd" * 32}
    assert frozen("ef" * 32, companions) == content_digest("ef" * 32, companions) != "ef" * 32
    assert frozen("ef" * 32, {}) == content_digest("ef" * 32, {}) == "ef" * 32
